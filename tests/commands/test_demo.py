"""`kvtier demo` end to end on a tiny local model: the report lines, the JSON, the KV mostly on disk, the comparison.

A random tiny model cannot find the fact; what is checked is the mechanics and the verdict logic.
"""

import json

from kvtier.cli import main


def run_demo(model_dir, storage_dir, capsys, *extra: str):
    rc = main(["demo", "--model", str(model_dir), "--context-tokens", "600", "--corpus", "generated",
               "--max-new-tokens", "3", "--device-kv-budget", "64KiB", "--host-kv-budget", "32KiB",
               "--storage-dir", str(storage_dir), "--json", *extra])
    return rc, capsys.readouterr()


def test_demo_reports_the_verdict_and_puts_most_kv_on_disk(tiny_model_dir, tmp_path, capsys):
    rc, captured = run_demo(tiny_model_dir, tmp_path, capsys)
    assert rc == 0, captured.err
    lines = captured.out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["expected"] and result["found"] in (True, False)
    assert result["kv_mode"] == "sparse" and result["dtype"] == "float32"  # what `make run` runs (demo.py says why)
    assert result["kv_bytes"]["storage"] > result["kv_bytes"]["host"] + result["kv_bytes"]["device"]
    assert any(line.startswith("expected: ") and "FOUND" in line for line in lines)
    assert any(line.startswith("KV on disk at the end: ") for line in lines)
    versus = result["versus"]  # the same question answered with full offload, by default
    assert versus["kv_mode"] == "offload" and versus["prefill_tokens"] == result["prefill_tokens"]
    assert versus["disk_bytes_read"] > result["disk_bytes_read"]  # offload reads every token's K/V each step
    assert sum(line.startswith("expected: ") for line in lines) == 2
    assert any(line.startswith("sparse decodes at ") and "x offload's speed" in line for line in lines)


def test_demo_versus_none_answers_once(tiny_model_dir, tmp_path, capsys):
    rc, captured = run_demo(tiny_model_dir, tmp_path, capsys, "--versus", "none")
    assert rc == 0, captured.err
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert "versus" not in result and captured.out.count("expected: ") == 1
