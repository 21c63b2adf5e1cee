import json

import pytest

from kvtier.errors import StorageError
from kvtier.eval.record import ResultStore, cell_key, disk_info, machine_info, spread


def test_cell_key_is_independent_of_argument_order():
    assert cell_key(mode="sparse", context=2048) == cell_key(context=2048, mode="sparse") == "context=2048,mode=sparse"


def test_spread_reports_median_and_range():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    with pytest.raises(ValueError):
        spread([])


def test_machine_info_names_cores_memory_versions_and_disk(tmp_path):
    info = machine_info(tmp_path)
    assert info["cpu_cores"] >= 1 and info["memory_bytes"] > 0
    assert info["versions"]["torch"] and info["versions"]["kvtier"]
    assert info["disk"]["fstype"] and info["disk"]["path"] == str(tmp_path)


def test_disk_info_of_proc_is_procfs():
    assert disk_info(__import__("pathlib").Path("/proc/self"))["fstype"] == "proc"


def test_finished_cells_survive_a_restart_and_are_skipped(tmp_path):
    path = tmp_path / "exp.json"
    store = ResultStore(path, {"model": "m"})
    store.put(cell_key(context=1024), {"ms": 5.0})
    again = ResultStore(path, {"model": "m"})
    assert again.done(cell_key(context=1024)) and again.get(cell_key(context=1024)) == {"ms": 5.0}
    assert not ResultStore(path, {"model": "m"}, force=True).done(cell_key(context=1024))
    assert [p.name for p in tmp_path.iterdir()] == ["exp.json"]  # no partial files left


def test_cells_run_with_other_settings_are_kept_unless_forced(tmp_path):
    path = tmp_path / "exp.json"
    ResultStore(path, {"model": "m", "alpha": 0.2}).put(cell_key(context=1024), {"ms": 5.0})
    with pytest.raises(StorageError, match=r"1 finished cells run with other settings \(alpha: 0.2 there, 0.1 now\)"):
        ResultStore(path, {"model": "m", "alpha": 0.1})
    assert ResultStore(path, {"model": "m", "alpha": 0.2}).done(cell_key(context=1024))  # nothing was lost
    assert not ResultStore(path, {"model": "m", "alpha": 0.1}, force=True).done(cell_key(context=1024))


def test_corrupt_results_file_is_a_clear_error_and_is_kept(tmp_path):
    path = tmp_path / "exp.json"
    path.write_text("{not json")
    with pytest.raises(StorageError, match="unreadable"):
        ResultStore(path, {})
    assert path.read_text() == "{not json"


def test_unwritable_results_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = ResultStore(blocker / "exp.json", {})
    with pytest.raises(StorageError, match="cannot write results"):
        store.put("a", {})


def test_saved_file_is_json_with_machine_and_settings(tmp_path):
    store = ResultStore(tmp_path / "exp.json", {"alpha": 0.2}, storage_dir=tmp_path)
    store.put("a", {"x": 1})
    saved = json.loads((tmp_path / "exp.json").read_text())
    assert saved["settings"] == {"alpha": 0.2} and saved["cells"] == {"a": {"x": 1}} and "machine" in saved
