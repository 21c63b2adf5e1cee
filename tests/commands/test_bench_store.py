"""`kvtier bench store` end to end on a tiny local model: two questions per repeat, each its own process."""

import json

import pytest

from kvtier.cli import main


def test_the_second_question_reuses_the_document_and_the_result_says_so(tiny_model_dir, tmp_path):
    rc = main(["bench", "store", "--model", str(tiny_model_dir), "--context", "700", "--repeats", "2",
               "--new-tokens", "2", "--corpus", "generated", "--out", str(tmp_path / "results")])
    assert rc == 0
    result = json.loads(next((tmp_path / "results").glob("store-*.json")).read_text())
    pairs = result["modes"]["dense"]
    assert len(pairs["runs"]) == 2
    for run in pairs["runs"]:
        assert run["first"]["reused_prompt_tokens"] == 0 and run["second"]["reused_prompt_tokens"] >= 512
        assert run["second"]["kv_store_bytes_read"] > 0 and run["ratio"] == pytest.approx(
            run["second"]["ttft_s"] / run["first"]["ttft_s"])
    assert "| dense |" in next((tmp_path / "results").glob("store-*.md")).read_text()


def test_an_unknown_mode_is_a_one_line_error(tmp_path, capsys):
    assert main(["bench", "store", "--kv", "h2o", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().startswith("kvtier: error: --kv takes dense, offload, sparse")
