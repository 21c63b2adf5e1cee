"""`kvtier demo` end to end on a tiny local model: the report lines, the JSON, the KV mostly on disk.

A random tiny model cannot find the fact; what is checked is the mechanics and the verdict logic.
"""

import json

from kvtier.cli import main


def test_demo_reports_the_verdict_and_puts_most_kv_on_disk(tiny_model_dir, tmp_path, capsys):
    rc = main(["demo", "--model", str(tiny_model_dir), "--context-tokens", "600", "--corpus", "generated",
               "--max-new-tokens", "3", "--device-kv-budget", "64KiB", "--host-kv-budget", "32KiB",
               "--storage-dir", str(tmp_path), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = captured.out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["expected"] and result["found"] in (True, False)
    assert result["kv_mode"] == "sparse" and result["dtype"] == "float32"  # what `make run` runs (demo.py says why)
    assert result["kv_bytes"]["storage"] > result["kv_bytes"]["host"] + result["kv_bytes"]["device"]
    assert any(line.startswith("expected: ") and "FOUND" in line for line in lines)
    assert any(line.startswith("KV on disk at the end: ") for line in lines)
