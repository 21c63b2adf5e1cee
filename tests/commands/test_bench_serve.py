"""`kvtier bench serve` end to end on a tiny local model: the default workload's shape really swaps.

Mechanics only: no assertion here is about speed. The scheduler's decisions depend only on token
counts (fixed-length outputs), so the tiny model swaps exactly where smollm2-135m would.
"""

import json

from kvtier.cli import main


def test_default_scale_forces_swapping_and_writes_json_and_markdown(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    rc = main(["bench", "serve", "--model", str(tiny_model_dir), "--repeats", "1", "--sweep", "",
               "--io-threads", "2", "--init-size", "4MiB", "--flash-dir", str(tmp_path / "flash"), "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "serve.json").read_text())
    flash, dram = result["throughput"]["flash"], result["throughput"]["dram"]
    assert flash["scheduler"]["swap_outs"] == dram["scheduler"]["swap_outs"] > 0
    assert flash["scheduler"]["recomputes"] == 0 and result["throughput"]["recompute"]["scheduler"]["recomputes"] > 0
    assert result["same_outputs"] and result["flash_vs_dram"] > 0
    assert result["allocation"]["engine_log"]["sequential_share"] == 1.0
    assert "flash / DRAM throughput" in (out / "serve.md").read_text()


def test_without_extra_runs_only_flash_and_dram_run_then_the_sweep(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    rc = main(["bench", "serve", "--model", str(tiny_model_dir), "--scale", "0.01", "--repeats", "1", "--sweep", "16",
               "--no-extra-runs", "--io-threads", "2", "--init-size", "4MiB", "--flash-dir", str(tmp_path / "flash"),
               "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "serve.json").read_text())
    assert set(result["throughput"]) == {"flash", "dram"} and result["allocation"]["engine_naive"] is None
    assert [row["block_tokens"] for row in result["block_size_sweep"]] == [16]
    assert "not run (`--no-extra-runs`)" in (out / "serve.md").read_text()
