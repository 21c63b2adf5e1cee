"""kvtier.data.ruler.sample: fitting a sample to a context, and RULER's string-match score."""

import pytest

from kvtier.data.ruler.sample import RulerSample, fit, string_match_all
from kvtier.errors import ConfigError


def _make(size: int) -> RulerSample:
    return RulerSample("toy", "x" * size, "Answer:", ("x",), answer_tokens=7)


def _measure(sample: RulerSample) -> int:
    """A prompt of 13 tokens plus one token per 3 characters, rounded up: not a straight line."""
    return 13 + -(-len(sample.context) // 3)


@pytest.mark.parametrize("context", [21, 100, 1000, 4096, 16384])
def test_fit_finds_the_largest_size_that_leaves_room_for_the_answer(context):
    sample = fit(_make, _measure, context)
    size = len(sample.context)
    assert _measure(sample) + sample.answer_tokens <= context
    assert _measure(_make(size + 3)) + sample.answer_tokens > context  # three more characters would not fit


def test_a_context_too_small_for_the_smallest_sample_is_refused():
    with pytest.raises(ConfigError, match="cannot hold even the smallest toy sample"):
        fit(_make, _measure, 20)


def test_the_score_is_the_share_of_expected_strings_named_case_ignored():
    expected = ("4817502", "ABCDE", "lantern")
    assert string_match_all("The numbers are 4817502, abcde and LANTERN.", expected) == 1.0
    assert string_match_all("4817502 and lanterns", expected) == pytest.approx(2 / 3)  # RULER matches substrings
    assert string_match_all("48175 02", expected) == 0.0
    assert string_match_all("", ("a",)) == 0.0
