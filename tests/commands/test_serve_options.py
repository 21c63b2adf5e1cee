"""The serving engine's options: the tiered sequences attend the budget --alpha / --top-p give."""

import argparse
from types import SimpleNamespace

import pytest

from kvtier.commands.serve_options import add_engine_options, tiers_from
from kvtier.errors import ConfigError

LLM = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa")))  # what tiers read


def options(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv, alpha, top_p", [((), 0.2, None), (("--alpha", "0.1"), 0.1, None),
                                                 (("--alpha", "auto"), 0.2, 0.9), (("--top-p", "0.8"), 0.2, 0.8)])
def test_the_tiered_sequences_attend_the_budget_the_options_give(argv, alpha, top_p):
    settings = tiers_from(options(*argv), LLM).settings
    assert (settings.alpha, settings.top_p) == (alpha, top_p)


def test_a_budget_out_of_range_fails_in_one_line():
    with pytest.raises(ConfigError, match="--top-p"):
        tiers_from(options("--top-p", "1.5"), LLM)
    assert tiers_from(options("--no-sparse", "--alpha", "auto"), LLM) is None
