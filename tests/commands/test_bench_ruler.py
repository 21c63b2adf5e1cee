"""`kvtier bench ruler` end to end on a tiny local model: results, markdown, plot, REPORT.md; one-line errors."""

import json

import pytest

from kvtier.cli import main


def _bench(model_dir, tmp_path, *extra):
    (tmp_path / "kv").mkdir(exist_ok=True)
    return main(["bench", "ruler", "--model", str(model_dir), "--contexts", "512", "--samples", "1",
                 "--corpus", "generated", "--beta", "0.5", "--storage-dir", str(tmp_path / "kv"),
                 "--out", str(tmp_path / "out"), *extra])


def test_writes_results_markdown_and_a_plot_that_the_report_links(tiny_model_dir, tmp_path, capsys):
    assert _bench(tiny_model_dir, tmp_path, "--tasks", "niah_single_noise,cwe", "--modes", "dense,offload,quest") == 0
    out = tmp_path / "out"
    data = json.loads((out / f"ruler-{tiny_model_dir.name}.json").read_text())
    assert len(data["cells"]) == 2 * 3 and data["grid"]["contexts"] == [512]
    assert data["settings"]["suite_modes"]["quest"] == {"kv": "quest", "alpha": 0.2}
    markdown = (out / f"ruler-{tiny_model_dir.name}.md").read_text()
    assert markdown in capsys.readouterr().out and "| quest |" in markdown
    assert (out / "plots" / f"ruler-{tiny_model_dir.name}.png").stat().st_size > 0
    assert main(["bench", "report", "--results", str(out)]) == 0
    report = (out / "REPORT.md").read_text()
    assert "## RULER-style suite (kvtier bench ruler)" in report
    assert f"![retention per task family](plots/ruler-{tiny_model_dir.name}.png)" in report


@pytest.mark.parametrize("args, message", [
    (["--tasks", "qa"], "unknown task qa; choose from niah_single_essay"),
    (["--modes", "sparse"], "unknown suite mode sparse; choose from dense, offload, sparse-0.2"),
    (["--contexts", "4k"], "--contexts takes comma-separated token counts"),
    (["--samples", "0"], "--samples must be at least 1"),
    (["--contexts", "9000"], "exceed"),
])
def test_bad_options_are_one_line_errors(tiny_model_dir, tmp_path, capsys, args, message):
    assert _bench(tiny_model_dir, tmp_path, *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvtier: error: ") and message in err[-1]
