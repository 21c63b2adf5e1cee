from pathlib import Path

from kvtier.models.paths import assembled_dir, cache_dir, converted_dir, stamps_dir


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
