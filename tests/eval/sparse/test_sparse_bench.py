"""`kvtier bench sparse`'s experiment pieces: the recall probe and the result files (the command runs end to end in
tests/commands/test_bench_sparse.py). Mechanics only: no assertion here is about speed."""

import pytest
import tiny_models
import torch

from kvtier.eval.sparse.prefill_tape import record
from kvtier.eval.sparse.sparse_bench import selection_recall, write_results


def test_recall_is_the_same_whether_the_prompt_is_fed_whole_or_in_chunks(tiny_llm):
    """The capture must keep the causal mask: without it, chunks after the first attended only to themselves."""
    model = tiny_llm.model
    ids = torch.randint(0, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    whole = selection_recall(model, record(model, ids, 1000), 0.2)
    chunked = selection_recall(model, record(model, ids, 64), 0.2)  # 192 tokens replayed, 8 computed
    assert whole.keys() == chunked.keys()
    for name in whole:
        if name != "edge_mass":
            assert chunked[name]["recall"] == pytest.approx(whole[name]["recall"], abs=1e-6)
    assert chunked["edge_mass"] == pytest.approx(whole["edge_mass"], abs=1e-5)


def test_the_lookahead_row_covers_the_layers_it_predicts():
    """Four layers, the first two not predicted: the row averages layers 2 and 3, whose predicted queries, unlike
    the real ones, come from the previous layer's input (so it cannot simply equal the sum-int8 row)."""
    model = tiny_models.tiny_llama(num_hidden_layers=4)
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    recall = selection_recall(model, record(model, ids, 1000), 0.2)
    assert 0.0 < recall["lookahead-sum-int8"]["recall"] <= 1.0
    assert recall["lookahead-sum-int8"] != recall["sum-int8"]
    for bits in (8, 4):  # the path's own choice, with and without the lookahead
        assert 0.0 < recall[f"sum-int{bits} shortlist"]["recall"] <= 1.0
        assert recall[f"lookahead-sum-int{bits} shortlist"] != recall[f"sum-int{bits} shortlist"]


def test_the_step_ahead_rows_rank_the_first_layers_with_the_query_of_the_step_before():
    """The first two layers at the second decode step: with the first step's query the shortlist differs from the one
    their own query draws up."""
    model = tiny_models.tiny_llama(num_hidden_layers=4)
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    recall = selection_recall(model, record(model, ids, 1000), 0.2)
    for bits in (8, 4):
        ahead = recall[f"step-ahead sum-int{bits} shortlist"]
        own = recall[f"step-ahead layers, own query, sum-int{bits} shortlist"]
        assert 0.0 < ahead["recall"] <= 1.0 and 0.0 < own["recall"] <= 1.0
        assert ahead != own


def _empty_result(score_bits: int) -> dict:
    return {"model": "qwen2.5-0.5b", "context": 256, "batch": 1, "alpha": 0.2, "score_bits": score_bits,
            "host_budget_bytes": 4096, "prompt_kv_bytes": 8192, "new_tokens": 2, "torch_threads": 1, "modes": {},
            "recall": {}}


def test_result_files_keep_a_dotted_model_name_whole(tmp_path):
    write_results(_empty_result(4), tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["sparse-qwen2.5-0.5b-256-b1.json",
                                                                "sparse-qwen2.5-0.5b-256-b1.md"]


def test_an_int8_run_does_not_overwrite_the_default_int4_result(tmp_path):
    write_results(_empty_result(4), tmp_path)
    write_results(_empty_result(8), tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "sparse-qwen2.5-0.5b-256-b1-int8.json", "sparse-qwen2.5-0.5b-256-b1-int8.md",
        "sparse-qwen2.5-0.5b-256-b1.json", "sparse-qwen2.5-0.5b-256-b1.md"]
    assert "INT8 sketches" in (tmp_path / "sparse-qwen2.5-0.5b-256-b1-int8.md").read_text()
