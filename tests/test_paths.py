import os
import subprocess
import sys
from pathlib import Path

from kvtier.paths import (
    assembled_dir,
    cache_dir,
    converted_dir,
    partial_path,
    remove_abandoned_partials,
    stamps_dir,
)


def test_explicit_cache_dir_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "k"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "k"


def test_xdg_cache_home_is_next(monkeypatch, tmp_path):
    monkeypatch.delenv("KVTIER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kvtier"


def test_home_cache_is_the_fallback(monkeypatch, tmp_path):
    monkeypatch.delenv("KVTIER_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == Path(tmp_path) / ".cache" / "kvtier"


def test_subdirectories_live_under_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    assert assembled_dir() == tmp_path / "models"
    assert stamps_dir() == tmp_path / "stamps"
    assert converted_dir() == tmp_path / "converted"
    assert not any(tmp_path.iterdir())  # asking for a path creates nothing


def _pid_of_finished_process() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_partial_path_is_hidden_and_names_this_process(tmp_path):
    assert partial_path(tmp_path / "m.gguf") == tmp_path / f".m.gguf.partial-{os.getpid()}"


def test_only_partials_of_dead_writers_are_removed(tmp_path):
    final = tmp_path / "abc"
    dead = _pid_of_finished_process()
    (tmp_path / f".abc.partial-{dead}").mkdir()
    (tmp_path / f".abc.partial-{dead}" / "model.safetensors").write_bytes(b"half")
    (tmp_path / f".abc.partial-{dead + 1}x").write_bytes(b"not ours")
    partial_path(final).write_bytes(b"in progress")
    (tmp_path / f".other.partial-{dead}").write_bytes(b"another file's")
    remove_abandoned_partials(final)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".abc.partial-{dead + 1}x", partial_path(final).name, f".other.partial-{dead}"]
    )


def test_removing_partials_of_a_missing_directory_is_a_no_op(tmp_path):
    remove_abandoned_partials(tmp_path / "absent" / "abc")
    assert not (tmp_path / "absent").exists()
