"""`kvtier bench accuracy` end to end on a tiny local model: files, skipped cells on re-run, one-line errors."""

import json

import pytest

from kvtier.cli import main
from kvtier.eval.accuracy import accuracy_bench

MODES = "dense,offload,sparse"


def _bench(model_dir, tmp_path, *extra):
    return main(["bench", "accuracy", "--model", str(model_dir), "--contexts", "256", "--depths", "0.5",
                 "--variants", "single,multi-key", "--ppl-tokens", "3", "--corpus", "generated", "--beta", "0.5",
                 "--storage-dir", str(tmp_path / "kv"), "--out", str(tmp_path / "out"), *extra])


def _one_line_error(capsys, rc) -> str:
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("kvtier: error: ")
    return err.strip().splitlines()[-1]


def test_writes_json_and_markdown_then_skips_finished_cells(tiny_model_dir, tmp_path, capsys, monkeypatch):
    (tmp_path / "kv").mkdir()
    assert _bench(tiny_model_dir, tmp_path, "--modes", MODES) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "out" / f"accuracy-{tiny_model_dir.name}.json").read_text())
    cells = data["cells"].values()
    assert len(cells) == 3 * 2 + 3  # (needle variants + one perplexity cell) per mode
    assert {cell["mode"] for cell in cells} == set(MODES.split(","))
    assert data["settings"]["cache_bypass"] and data["settings"]["host_share"] == 0.4
    assert data["machine"]["cpu_cores"] >= 1 and data["machine"]["versions"]["torch"]
    assert data["grid"]["seeds"] == 1 and data["grid"]["modes"] == MODES.split(",") and data["grid"]["contexts"] == [256]
    ppl = {cell["mode"]: cell for cell in cells if cell["kind"] == "ppl"}
    assert ppl["offload"]["ppl"] == ppl["dense"]["ppl"] and ppl["offload"]["attention_mass_recall"] == 1.0
    assert 0.0 < ppl["sparse"]["attention_mass_recall"] <= 1.0 and ppl["sparse"]["recall_by_layer"]
    assert all(cell["host_kv_budget"] > 0 and cell["device_kv_budget"] > 0 for cell in cells)
    markdown = (tmp_path / "out" / f"accuracy-{tiny_model_dir.name}.md").read_text()
    assert "## Needle in a haystack" in markdown and "## Perplexity and attention-mass recall" in markdown
    assert "| sparse | 256 |" in markdown and markdown in out

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished cell ran again")

    monkeypatch.setattr(accuracy_bench, "needle_cell", must_not_run)
    monkeypatch.setattr(accuracy_bench, "perplexity_cell", must_not_run)
    assert _bench(tiny_model_dir, tmp_path, "--modes", MODES) == 0
    assert "9 cells, 9 already finished" in capsys.readouterr().err


def test_markdown_shows_the_cells_of_earlier_grids_too(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "kv").mkdir()
    assert _bench(tiny_model_dir, tmp_path, "--modes", "dense") == 0
    assert _bench(tiny_model_dir, tmp_path, "--modes", "dense", "--contexts", "320", "--ppl-tokens", "2") == 0
    markdown = (tmp_path / "out" / f"accuracy-{tiny_model_dir.name}.md").read_text()
    assert "| dense | 256 | 3 |" in markdown and "| dense | 320 | 2 |" in markdown  # both runs, each with its steps


def test_unknown_mode_is_a_one_line_error(tiny_model_dir, tmp_path, capsys):
    line = _one_line_error(capsys, _bench(tiny_model_dir, tmp_path, "--modes", "dense,turbo"))
    assert "unknown KV mode turbo" in line and "dense" in line


def test_context_beyond_the_model_is_a_one_line_error(tiny_model_dir, tmp_path, capsys):
    line = _one_line_error(capsys, _bench(tiny_model_dir, tmp_path, "--modes", "dense", "--contexts", "8100"))
    assert "8100" in line and "at most" in line


def test_unwritable_out_is_a_one_line_error(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "out").write_text("a file, not a directory")
    line = _one_line_error(capsys, _bench(tiny_model_dir, tmp_path, "--modes", "dense"))
    assert "results directory" in line


@pytest.mark.parametrize("option, value", [("--depths", "0.5,1.5"), ("--variants", "single,haystack"),
                                           ("--contexts", "1024,lots"), ("--host-share", "0")])
def test_bad_grid_options_are_one_line_errors(tiny_model_dir, tmp_path, capsys, option, value):
    _one_line_error(capsys, _bench(tiny_model_dir, tmp_path, "--modes", "dense", option, value))
