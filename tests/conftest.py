"""Shared test set-up: make tests/ importable (tiny_models) under pytest's importlib mode, and keep
the APP calibrations and document KV store entries that tests make out of the user's kvtier cache."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def calibration_outside_the_user_cache(monkeypatch, tmp_path_factory):
    """Calibrations go to this session's temp directory (shared by its tests: calibrating takes seconds).

    Only the planner's cache directory moves: the packaged models stay where `kvtier models pull` put them.
    """
    from kvtier.sparse import planner

    monkeypatch.setattr(planner, "cache_dir", tmp_path_factory.getbasetemp)


@pytest.fixture(autouse=True)
def document_store_outside_the_user_cache(monkeypatch, tmp_path_factory):
    """`kvtier generate` stores prompts by default: in tests, under this session's temp directory."""
    from kvtier.docstore import document_store

    monkeypatch.setattr(document_store, "default_store_dir", lambda: tmp_path_factory.getbasetemp() / "kv-store")
