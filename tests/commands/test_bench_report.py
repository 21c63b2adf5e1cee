"""`kvtier bench report` end to end: a report from a real tiny latency run, appendices, one-line errors."""

import json
import sys

from kvtier.cli import main

SPARSE_RESULT = {"model": "tiny", "context": 256, "batch": 1, "alpha": 0.2, "score_bits": 8, "host_budget_bytes": 4096,
                 "prompt_kv_bytes": 8192, "new_tokens": 2, "torch_threads": 1, "modes": {}, "recall": {}}


def _error(capsys, *argv) -> str:
    """Run `kvtier argv`: it must exit 2 with one error line last on stderr and no traceback; that line."""
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("kvtier: error: ") and not any("Traceback" in line for line in lines)
    return lines[-1]


def test_report_of_a_latency_run_has_its_table_and_plot(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "results"
    (tmp_path / "kv").mkdir()
    assert main(["bench", "latency", "--model", str(tiny_model_dir), "--experiments", "a", "--modes", "dense,offload",
                 "--contexts", "256", "--new-tokens", "2", "--repeats", "1", "--corpus", "generated",
                 "--storage-dir", str(tmp_path / "kv"), "--out", str(out)]) == 0
    (out / "sparse-tiny-256-b1.json").write_text(json.dumps(SPARSE_RESULT))
    capsys.readouterr()
    assert main(["bench", "report", "--results", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    report = (out / "REPORT.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| 256 |"))
    assert row.count("|") == 4  # context, dense, offload
    assert "_Not run yet: `kvtier bench latency --experiments b`._" in report
    assert "## Sparse vs offload (`sparse-tiny-256-b1.json`)" in report and "### sparse vs offload: tiny" in report
    assert (out / "plots" / f"latency-context-{tiny_model_dir.name}-small.png").stat().st_size > 0


def test_missing_matplotlib_is_a_one_line_error_naming_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    line = _error(capsys, "bench", "report", "--results", str(tmp_path))
    assert "pip install 'kvtier[bench]'" in line and not (tmp_path / "REPORT.md").exists()


def test_unwritable_results_dir_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "blocker").write_text("")
    line = _error(capsys, "bench", "report", "--results", str(tmp_path / "blocker" / "results"))
    assert "is not writable" in line
