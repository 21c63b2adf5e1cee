"""Fixtures for the sparse path: tiny random models and single-threaded torch (see selective_fixtures.py), and a
watcher of the scorer's candidate reads in flight."""

import threading

import pytest

from selective_fixtures import one_torch_thread, tiny_gemma3, tiny_llama  # noqa: F401  (pytest fixtures)


@pytest.fixture()
def quiet_waiter():
    """Call with a CandidatesFirst: an event set once its `wait_quiet()` returned, on a thread of its own."""
    def start(first) -> threading.Event:
        returned = threading.Event()
        threading.Thread(target=lambda: (first.wait_quiet(), returned.set()), daemon=True).start()
        return returned
    return start
