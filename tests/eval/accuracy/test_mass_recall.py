"""Attention-mass recall: the formula on hand-made tensors, and the dense lockstep on a tiny model."""

import dataclasses
import math

import pytest
import torch

import tiny_models
from kvtier.eval.accuracy.mass_recall import AttendedPositions, DenseAttentionProbe, mass_recall, reports_attended
from kvtier.eval.accuracy.budgets import BudgetShares, cell_kv_config
from kvtier.eval.accuracy.perplexity import perplexity_cell
from kvtier.modes import KVConfig, make_cache


def test_mass_recall_is_the_mean_over_query_heads_of_the_attended_probability():
    # One KV head shared by two query heads; three keys. Head 0 prefers key 0, head 1 key 2.
    keys = torch.tensor([[[[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]]]])  # [B=1, Hkv=1, N=3, D=2]
    query = torch.tensor([[[[2.0, 0.0]], [[0.0, 2.0]]]])  # [B=1, Hq=2, 1, D=2]
    head0 = torch.tensor([2.0, 0.0, 0.0]).softmax(0)
    head1 = torch.tensor([0.0, 0.0, 2.0]).softmax(0)
    expected = (head0[[0, 1]].sum() + head1[[0, 1]].sum()) / 2
    assert mass_recall(query, keys, 1.0, torch.tensor([[0, 1]])) == pytest.approx(float(expected))
    assert mass_recall(query, keys, 1.0, torch.tensor([[0, 1, 2]])) == pytest.approx(1.0)


def test_attended_positions_keeps_the_last_report_per_layer_until_taken():
    attended = AttendedPositions()
    attended(3, [[0, 5]])
    attended(3, [[1, 2, 4]])
    attended(7, [[9]])
    taken = attended.take()
    assert taken[3].tolist() == [[1, 2, 4]] and taken[3].dtype == torch.int64 and taken[7].tolist() == [[9]]
    assert attended.take() == {}


def test_probe_captures_only_one_token_queries_inside_capturing_and_restores_attention(tiny_llm):
    model = tiny_llm.model
    before = model.config._attn_implementation
    ids = torch.arange(10, 30)[None, :]
    with torch.inference_mode(), DenseAttentionProbe(model) as probe:
        cache = make_cache(model, KVConfig(), 32)
        with probe.capturing():
            model(input_ids=ids, cache=cache)  # prefill: not a decode query
        assert probe.captured == {}
        model(input_ids=ids[:, :1], cache=cache)  # outside capturing
        assert probe.captured == {}
        with probe.capturing():
            model(input_ids=ids[:, :1], cache=cache)
        query, keys, _ = probe.captured[0]
        assert set(probe.captured) == {0, 1} and query.shape == (1, 4, 1, 16) and keys.shape == (1, 2, 22, 16)
        assert probe.recall({1: torch.arange(22)[None, :]})[1] == pytest.approx(1.0)
    assert model.config._attn_implementation == before


def test_dense_and_offload_do_not_report_attended_positions_sparse_does(tiny_llm, tmp_path):
    model = tiny_llm.model
    sparse = make_cache(model, _sparse_config(tiny_llm, tmp_path, alpha=0.2), 300)
    try:
        assert reports_attended(sparse)
        assert not reports_attended(make_cache(model, KVConfig(), 300))
    finally:
        sparse.close()


def test_sparse_at_alpha_one_keeps_all_attention_mass(tiny_llm, corpus_text, tmp_path):
    result = perplexity_cell(tiny_llm, _sparse_config(tiny_llm, tmp_path, alpha=1.0), 300, 3, 0, corpus_text)
    assert result["attention_mass_recall"] == pytest.approx(1.0, abs=1e-5)
    assert set(result["recall_by_layer"]) == {0, 1}
    assert result["mass_estimate_mae"] == pytest.approx(0.0, abs=1e-5)  # every token attended: nothing to estimate


def test_sparse_at_small_alpha_loses_attention_mass(tiny_llm, corpus_text, tmp_path):
    result = perplexity_cell(tiny_llm, _sparse_config(tiny_llm, tmp_path, alpha=0.05), 300, 3, 0, corpus_text)
    # The sink and recent window (4 + 16 of 300 tokens) and 5% of the rest cannot hold all of it.
    assert 0.0 < result["attention_mass_recall"] < 0.9
    assert math.isfinite(result["ppl"])
    assert 0.0 <= result["mass_estimate_mae"] < 0.5 and abs(result["mass_estimate_bias"]) <= result["mass_estimate_mae"]


def test_the_top_p_budgets_estimate_is_checked_against_the_dense_mass(tiny_llm, corpus_text, tmp_path):
    config = dataclasses.replace(_sparse_config(tiny_llm, tmp_path, alpha=0.2), top_p=0.9)
    result = perplexity_cell(tiny_llm, config, 300, 3, 0, corpus_text)
    assert 0.0 < result["attention_mass_recall"] <= 1.0 and result["mass_estimate_mae"] is not None
    assert perplexity_cell(tiny_llm, KVConfig(), 64, 2, 0, corpus_text)["mass_estimate_mae"] is None


def test_sliding_window_layers_are_not_reported_and_global_layers_keep_all_mass_at_alpha_one(tiny_llm, corpus_text,
                                                                                           tmp_path):
    # Gemma 3 layout: only the full-attention layer is tiered (and selective); sliding layers stay dense.
    model = tiny_models.tiny_gemma3(["sliding_attention", "full_attention", "sliding_attention"],
                                    vocab_size=tiny_llm.model.config.vocab_size, max_position_embeddings=8192)
    gemma = dataclasses.replace(tiny_llm, model=model, config=model.config, name="tiny-gemma3", model_id="tiny-gemma3")
    result = perplexity_cell(gemma, _sparse_config(gemma, tmp_path, alpha=1.0), 300, 3, 0, corpus_text)
    assert set(result["recall_by_layer"]) == {1}
    assert result["attention_mass_recall"] == pytest.approx(1.0, abs=1e-5)


def _sparse_config(llm, storage_dir, alpha: float) -> KVConfig:
    return cell_kv_config("sparse", llm.model, 300, BudgetShares(), storage_dir=str(storage_dir), alpha=alpha,
                          beta=0.5, recent=16)
