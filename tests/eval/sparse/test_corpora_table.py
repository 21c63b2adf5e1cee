"""kvtier.eval.sparse.corpora_table: drift windows and the table of corpora x modes (the command's run is in
tests/commands/test_bench_sparse.py)."""

import pytest

from kvtier.eval.sparse.corpora_table import corpora_markdown, corpora_result, table_rows, window_medians


def test_window_medians_take_every_window_and_a_shorter_last_one():
    assert window_medians(list(range(1, 35)), 16) == [8.5, 24.5, 33.5]
    assert window_medians([], 16) == []


def _run(offload_ms: float, sparse_ms: float) -> dict:
    def row(ms, read, rounds):
        return {"median_step_ms": ms, "round_median_step_ms": rounds, "disk_read_bytes_per_step": read,
                "step_ms": [ms] * 20}
    return {"model": "m", "context": 100, "batch": 1, "device": "cpu", "new_tokens": 20, "repeats": 2,
            "modes": {"dense": row(50.0, 0, [50.0, 50.0]), "offload": row(offload_ms, 4096, [offload_ms] * 2),
                      "sparse-hit": row(sparse_ms, 1024, [sparse_ms, sparse_ms + 2])},
            "round_ratios": {"dense": [offload_ms / 50] * 2, "sparse-hit": [3.0, 2.0]}}


def test_one_row_per_corpus_and_mode_with_ratios_shares_and_drift():
    result = corpora_result({"code": _run(200.0, 80.0), "repetitive": _run(300.0, 150.0)})
    assert result["corpora"] == ["code", "repetitive"] and result["new_tokens"] == 20
    rows = {(row["corpus"], row["mode"]): row for row in table_rows(result)}
    assert len(rows) == 6
    sparse = rows["repetitive", "sparse-hit"]
    assert sparse["vs_offload"] == pytest.approx(2.5)  # the median of the rounds' ratios
    assert sparse["vs_dense_step"] == pytest.approx(3.0) and sparse["bytes_vs_offload"] == pytest.approx(0.25)
    assert sparse["window_medians_ms"] == [150.0, 150.0]
    assert rows["code", "offload"]["vs_offload"] is None and rows["code", "dense"]["bytes_vs_offload"] == 0
    text = corpora_markdown(result)
    assert "| repetitive | sparse-hit | 150.0 (150, 152) | 2.50x | 3.00x | 1.0KiB | 25% | 150 / 150 |" in text
    assert "| code | offload | 200.0 (200, 200) | - | 4.00x |" in text
