"""`kvtier bench latency` end to end on a tiny local model: result files, skipped cells on re-run, one-line errors.

Mechanics only: no assertion here is about speed.
"""

import json

from kvtier.cli import main

SMALL = ["--contexts", "256", "--fixed-context", "256", "--new-tokens", "2", "--repeats", "2", "--corpus", "generated"]


def _bench(model_dir, tmp_path, *extra):
    (tmp_path / "kv").mkdir(exist_ok=True)
    return main(["bench", "latency", "--model", str(model_dir), *SMALL, "--storage-dir", str(tmp_path / "kv"),
                 "--out", str(tmp_path / "out"), *extra])


def _one_line_error(capsys, rc) -> str:
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("kvtier: error: ")
    return err.strip().splitlines()[-1]


def test_writes_one_file_per_experiment_then_skips_finished_cells(tiny_model_dir, tmp_path, capsys):
    assert _bench(tiny_model_dir, tmp_path, "--experiments", "a,f", "--modes", "dense,offload") == 0
    captured = capsys.readouterr()
    files = sorted(path.name for path in (tmp_path / "out").iterdir())
    name = tiny_model_dir.name
    assert files == [f"latency-context-{name}-small.json", f"latency-traffic-{name}-small.json"]
    assert "bench report" in captured.out and "2 cells, 0 finished" in captured.err
    path = tmp_path / "out" / files[0]
    data = json.loads(path.read_text())
    assert data["settings"]["repeats"] == 2 and data["settings"]["host_share"] == 0.4
    assert data["settings"]["experiment"] == "context" and data["settings"]["new_tokens"] == 2
    assert data["machine"]["cpu_cores"] >= 1 and data["machine"]["memory_bytes"] > 0 and data["machine"]["disk"]
    assert data["machine"]["versions"]["torch"]
    cells = data["cells"].values()
    assert {cell["params"]["mode"] for cell in cells} == {"dense", "offload"}
    assert all(cell["ms_per_token"]["n"] == 2 and cell["budgets"]["host_kv_budget"] for cell in cells)
    assert {cell["cache_bypass"] for cell in cells} == {None, "O_DIRECT"}

    before = path.read_text()
    assert _bench(tiny_model_dir, tmp_path, "--experiments", "a", "--modes", "dense,offload") == 0
    assert "2 cells, 2 finished" in capsys.readouterr().err and path.read_text() == before
    assert _bench(tiny_model_dir, tmp_path, "--experiments", "a", "--modes", "dense", "--force") == 0
    assert "1 cells, 0 finished" in capsys.readouterr().err
    assert len(json.loads(path.read_text())["cells"]) == 1  # --force starts the file over


def test_unknown_mode_and_experiment_are_one_line_errors(tiny_model_dir, tmp_path, capsys):
    line = _one_line_error(capsys, _bench(tiny_model_dir, tmp_path, "--modes", "dense,turbo"))
    assert "unknown KV mode turbo" in line and "sparse" in line
    line = _one_line_error(capsys, _bench(tiny_model_dir, tmp_path, "--experiments", "a,speed"))
    assert "unknown experiment 'speed'" in line and "f (traffic)" in line
    line = _one_line_error(capsys, _bench(tiny_model_dir, tmp_path, "--contexts", "1k"))
    assert "--contexts takes comma-separated numbers" in line


def test_contexts_beyond_the_model_are_refused_before_running(tiny_model_dir, tmp_path, capsys):
    line = _one_line_error(capsys, _bench(tiny_model_dir, tmp_path, "--experiments", "a", "--contexts", "256,8190"))
    assert "contexts 8190 do not fit the 8192-token context" in line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_unwritable_out_is_a_one_line_error(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "blocker").write_text("")
    rc = main(["bench", "latency", "--model", str(tiny_model_dir), *SMALL, "--out", str(tmp_path / "blocker" / "out")])
    assert "is not writable" in _one_line_error(capsys, rc)
