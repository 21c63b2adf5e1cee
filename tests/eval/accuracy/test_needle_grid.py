"""Needle cells: prompts per variant, scoring of the answer, and accuracy/retention summaries."""

import pytest

from kvtier.errors import ConfigError
from kvtier.eval.accuracy import needle_grid
from kvtier.eval.accuracy.budgets import BudgetShares, cell_kv_config
from kvtier.eval.accuracy.needle_grid import MULTI_NEEDLES, needle_cell, needle_prompt, needle_summary
from kvtier.generation import GenerationResult
from kvtier.modes import KVConfig


def test_single_needle_sits_at_its_depth(tiny_llm, corpus_text):
    prompt = needle_prompt(tiny_llm.tokenizer, corpus_text, 600, 0.75, "single", 2)
    assert prompt.distractors == () and prompt.expected in prompt.document
    assert prompt.needle_token_positions[0] / prompt.context_tokens == pytest.approx(0.75, abs=0.05)


def test_multi_key_needles_differ_in_one_word_and_are_distractors(tiny_llm, corpus_text):
    prompt = needle_prompt(tiny_llm.tokenizer, corpus_text, 600, 0.2, "multi-key", 2)
    assert len(prompt.distractors) == MULTI_NEEDLES - 1
    asked = prompt.question.removeprefix("What is the ").split("?")[0]
    attribute_and_place = (asked.split(" of the ")[0], asked.split()[-1])
    sentences = [s for s in prompt.document.split(".") if " is " in s and any(v in s for v in prompt.distractors)]
    assert len(sentences) == MULTI_NEEDLES - 1
    assert all(attribute_and_place[0] in s and s.strip().split(" is ")[0].endswith(attribute_and_place[1])
               for s in sentences)
    assert prompt.needle_token_positions[0] / prompt.context_tokens == pytest.approx(0.2, abs=0.05)


def test_seeds_change_needles_and_haystack(tiny_llm, corpus_text):
    first = needle_prompt(tiny_llm.tokenizer, corpus_text, 300, 0.5, "multi-needle", 0)
    second = needle_prompt(tiny_llm.tokenizer, corpus_text, 300, 0.5, "multi-needle", 1)
    assert first.expected != second.expected and first.document[:200] != second.document[:200]


def test_unknown_variant_is_refused(tiny_llm, corpus_text):
    with pytest.raises(ConfigError, match="unknown needle variant"):
        needle_prompt(tiny_llm.tokenizer, corpus_text, 300, 0.5, "haystack-only", 0)


def test_needle_cell_runs_a_tiered_mode_and_reports_the_generation(tiny_llm, corpus_text, tmp_path):
    config = cell_kv_config("offload", tiny_llm.model, 400, BudgetShares(), storage_dir=str(tmp_path), block_tokens=16)
    cell = needle_cell(tiny_llm, config, 400, 0.5, "multi-needle", 0, corpus_text, max_new_tokens=3)
    assert cell["correct"] is False  # a random model does not find needles
    assert cell["prompt_tokens"] >= cell["document_tokens"] >= 390 and len(cell["distractors"]) == MULTI_NEEDLES - 1
    assert cell["disk_bytes_read"] > 0 and cell["ms_per_token"] > 0


@pytest.mark.parametrize("answer, correct", [("It is {expected}.", True), ("{expected} or {distractor}", False)])
def test_needle_cell_scores_the_answer_against_expected_and_distractors(tiny_llm, corpus_text, monkeypatch,
                                                                          answer, correct):
    prompt = needle_prompt(tiny_llm.tokenizer, corpus_text, 300, 0.5, "multi-key", 3)
    text = answer.format(expected=prompt.expected, distractor=prompt.distractors[0])
    fake = GenerationResult(text, [], "dense", 0, 1, 0.0, 0.0, 0.0, 0, 0)
    monkeypatch.setattr(needle_grid, "generate", lambda *args, **kwargs: fake)
    assert needle_cell(tiny_llm, KVConfig(), 300, 0.5, "multi-key", 3, corpus_text)["correct"] is correct


def _cell(mode, correct, context=1024, depth=0.5, variant="single", seed=0):
    return {"mode": mode, "correct": correct, "context": context, "depth": depth, "variant": variant, "seed": seed}


def test_summary_counts_per_variant_and_grid_and_retention_over_shared_cells():
    cells = [
        _cell("dense", True), _cell("dense", True, depth=0.9), _cell("dense", False, variant="multi-key"),
        _cell("dense", True, context=2048),  # sparse did not run this one: not part of its retention
        _cell("sparse", True), _cell("sparse", False, depth=0.9), _cell("sparse", False, variant="multi-key"),
    ]
    summary = needle_summary(cells)
    assert summary["sparse"]["all"] == {"accuracy": 1 / 3, "correct": 1, "n": 3}
    assert summary["sparse"]["variants"]["single"]["correct"] == 1
    assert summary["sparse"]["variants"]["multi-key"]["n"] == 1
    assert summary["sparse"]["grid"][1024][0.9]["accuracy"] == 0.0
    assert summary["sparse"]["retention"] == 0.5 and summary["dense"]["retention"] == 1.0


def test_retention_is_none_when_dense_never_answered():
    summary = needle_summary([_cell("dense", False), _cell("sparse", True)])
    assert summary["sparse"]["retention"] is None
    assert "dense" not in needle_summary([_cell("sparse", True)])
