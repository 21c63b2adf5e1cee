"""`kvtier demo` end to end on a tiny local model: the report lines, the JSON, the KV mostly on disk.

A random tiny model cannot find the fact; what is checked is the mechanics and the verdict logic.
"""

import json

from kvtier.commands.demo import verdict
from kvtier.cli import main
from kvtier.data.needle import make_needles


def test_demo_reports_the_verdict_and_puts_most_kv_on_disk(tiny_model_dir, tmp_path, capsys):
    rc = main(["demo", "--model", str(tiny_model_dir), "--context-tokens", "600", "--corpus", "generated",
               "--max-new-tokens", "3", "--device-kv-budget", "32KiB", "--host-kv-budget", "32KiB",
               "--storage-dir", str(tmp_path), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = captured.out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["expected"] and result["found"] in (True, False)
    assert result["kv_mode"] == "offload" and result["dtype"] == "bfloat16"  # what `make run` runs (demo.py says why)
    assert result["kv_bytes"]["storage"] > result["kv_bytes"]["host"] + result["kv_bytes"]["device"]
    assert any(line.startswith("expected: ") and "FOUND" in line for line in lines)
    assert any(line.startswith("KV on disk at the end: ") for line in lines)


def test_verdict_names_the_distractor_a_wrong_answer_gave():
    needles = make_needles(3, seed=7)
    expected = needles[1].value
    assert verdict(f"It is {expected}.", True, needles, expected) == "FOUND"
    wrong = verdict(f"The number is {needles[2].value}.", False, needles, expected)
    assert wrong == f"NOT FOUND (answered {needles[2].value}, the fact planted at depth 0.8)"
    assert verdict("no idea", False, needles, expected) == "NOT FOUND"
