"""`kvtier bench vllm-tier` end to end on a tiny stream: both tiers measured, every job done, files written."""

import json

from kvtier.cli import main


def test_bench_vllm_tier_compares_both_tiers_and_writes_results(tmp_path):
    out = tmp_path / "results"
    assert main(["bench", "vllm-tier", "--total", "2MiB", "--repeats", "2", "--restart-chunks", "300",
                 "--io-threads", "4", "--dir", str(tmp_path), "--out", str(out)]) == 0
    result = json.loads((out / "vllm-tier.json").read_text())
    for model in ("smollm2-135m", "qwen2.5-0.5b"):
        tiers = result["models"][model]["tiers"]
        assert set(tiers) == {"kvtier", "fs"}
        for row in tiers.values():
            assert row["failed_jobs"] == 0 and row["verified_chunks"] > 0 and row["store_gb_per_s"]["n"] == 2
        # the flash file, its index journal and the journal's lock file
        assert tiers["kvtier"]["files_created"] == 3 and tiers["kvtier"]["sequential_share"] == 1.0
        assert tiers["fs"]["files_created"] == 1 + tiers["fs"]["bytes_per_run"] // result["models"][model]["chunk_bytes"]
    assert result["restart"]["hits"] == {"kvtier": 300, "fs": 300}
    assert "| kvtier |" in (out / "vllm-tier.md").read_text()
    assert [path.name for path in tmp_path.iterdir()] == ["results"]  # the tiers' files are gone


def test_bench_vllm_tier_refuses_an_unknown_model(tmp_path, capsys):
    assert main(["bench", "vllm-tier", "--models", "gpt-17", "--dir", str(tmp_path)]) == 2
    assert "unknown model 'gpt-17'" in capsys.readouterr().err
