"""Teacher-forced perplexity through KV modes, corpus windows, and the per-mode summary."""

import math

import pytest

from kvtier.errors import ConfigError, ContextTooLongError
from kvtier.eval.accuracy.budgets import BudgetShares, cell_kv_config
from kvtier.eval.accuracy.perplexity import corpus_ids, perplexity_cell, perplexity_summary
from kvtier.modes import KVConfig


def test_offload_perplexity_equals_dense_exactly_with_most_kv_on_disk(tiny_llm, corpus_text, tmp_path):
    dense = perplexity_cell(tiny_llm, KVConfig(), 400, 6, 1, corpus_text)
    offload_config = cell_kv_config("offload", tiny_llm.model, 400, BudgetShares(), storage_dir=str(tmp_path),
                                    block_tokens=16)
    offload = perplexity_cell(tiny_llm, offload_config, 400, 6, 1, corpus_text)
    assert offload["nll"] == dense["nll"] and offload["ppl"] == dense["ppl"]
    assert dense["attention_mass_recall"] == offload["attention_mass_recall"] == 1.0
    assert dense["new_tokens"] == 6 and dense["prefix_tokens"] == 400
    assert math.isclose(dense["ppl"], math.exp(dense["nll"]))
    assert not list(tmp_path.iterdir())  # the offload KV file is gone


def test_a_mode_without_attended_reports_has_no_recall(tiny_llm, corpus_text, monkeypatch):
    monkeypatch.setattr("kvtier.eval.accuracy.perplexity.EXACT_MODES", ())
    assert perplexity_cell(tiny_llm, KVConfig(), 64, 2, 0, corpus_text)["attention_mass_recall"] is None


def test_corpus_ids_differ_by_seed_and_refuse_a_short_corpus(tiny_llm, corpus_text):
    first = corpus_ids(tiny_llm.tokenizer, corpus_text, 200, 0)
    second = corpus_ids(tiny_llm.tokenizer, corpus_text, 200, 1)
    assert first.shape == second.shape == (1, 200) and not first.equal(second)
    with pytest.raises(ConfigError, match="fewer than"):
        corpus_ids(tiny_llm.tokenizer, corpus_text[:500], 200, 0)


def test_a_prefix_beyond_the_context_is_refused(tiny_llm, corpus_text):
    with pytest.raises(ContextTooLongError):
        perplexity_cell(tiny_llm, KVConfig(), 8190, 8, 0, corpus_text)


def test_summary_gives_spread_over_seeds_and_delta_against_dense_of_the_same_seed():
    cells = [
        {"mode": "dense", "context": 1024, "seed": 0, "ppl": 10.0, "attention_mass_recall": 1.0},
        {"mode": "dense", "context": 1024, "seed": 1, "ppl": 20.0, "attention_mass_recall": 1.0},
        {"mode": "sparse", "context": 1024, "seed": 0, "ppl": 11.0, "attention_mass_recall": 0.9},
        {"mode": "sparse", "context": 1024, "seed": 1, "ppl": 23.0, "attention_mass_recall": 0.8},
        {"mode": "sparse", "context": 2048, "seed": 0, "ppl": 12.0, "attention_mass_recall": None},
    ]
    summary = perplexity_summary(cells)
    assert summary["sparse"][1024]["ppl"] == {"median": 17.0, "min": 11.0, "max": 23.0, "n": 2}
    assert summary["sparse"][1024]["ppl_delta"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 2}
    assert summary["sparse"][1024]["attention_mass_recall"]["median"] == pytest.approx(0.85)
    assert summary["sparse"][2048]["ppl_delta"] is None and summary["sparse"][2048]["attention_mass_recall"] is None
    assert summary["dense"][1024]["ppl_delta"]["median"] == 0.0
