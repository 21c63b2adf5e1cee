"""kvtier.eval.sparse.generate_table: rows per corpus and mode, ratios within rounds, answers against dense's."""

import json

import pytest

from kvtier.eval.sparse.generate_table import markdown, table_rows, write_results


def _run(ms: float, first: float, read: int, text: str) -> dict:
    return {"ms_per_token": ms, "first_steps_ms": first, "later_steps_ms": ms * 0.9, "disk_bytes_read": read,
            "ttft_s": 2.0, "text": text, "page_cache_dropped": True}


def _result() -> dict:
    runs = {"dense": [_run(100, 110, 0, "a"), _run(110, 120, 0, "b")],
            "offload": [_run(300, 330, 4000, "a"), _run(330, 360, 4000, "b")],
            "sparse": [_run(100, 220, 1000, "a"), _run(165, 240, 1000, "c")]}
    return {"model": "some/qwen2.5-0.5b", "context": 64, "max_new_tokens": 24, "device_kv_budget": "8MiB",
            "host_kv_budget": "48MiB", "rounds": 2, "first_steps": 4, "modes": list(runs),
            "corpora": {"code": {"runs": runs}}}


def test_ratios_are_taken_within_rounds_and_answers_compared_round_by_round():
    rows = {row["mode"]: row for row in table_rows(_result())}
    sparse = rows["sparse"]
    assert sparse["vs_offload"] == pytest.approx((3.0 + 2.0) / 2)  # rounds' ratios 3.0 and 2.0
    assert sparse["first_vs_offload"] == pytest.approx((1.5 + 1.5) / 2)
    assert sparse["bytes_vs_offload"] == pytest.approx(0.25) and sparse["same_as_dense"] is False
    assert rows["offload"]["same_as_dense"] is True and rows["offload"]["vs_offload"] is None
    assert rows["dense"]["ms_per_token"] == 105


def test_markdown_and_files_keep_a_dotted_model_name_whole(tmp_path, capsys):
    text = markdown(_result())
    assert "| code | sparse | 132.5 (100, 165) | 230.0 | 119.2 | 2.50x | 1.50x | 1000B | 25% | 2.00 | no |" in text
    assert "page cache dropped before every run" in text and '- code: "a"' in text
    write_results(_result(), tmp_path)
    assert json.loads((tmp_path / "generate-corpora-qwen2.5-0.5b-64.json").read_text())["context"] == 64
    assert (tmp_path / "generate-corpora-qwen2.5-0.5b-64.md").read_text() == text
