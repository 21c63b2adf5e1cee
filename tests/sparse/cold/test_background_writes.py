import threading

import pytest

from kvtier.sparse.cold.background_writes import BackgroundWrites


def test_writes_run_in_order_off_the_calling_thread_and_settle_waits_per_layer():
    writes, done, release = BackgroundWrites(), [], threading.Event()
    caller = threading.get_ident()
    try:
        writes.submit(0, lambda: (release.wait(5), done.append(("0a", threading.get_ident() != caller))))
        writes.submit(1, lambda: done.append(("1", True)))
        writes.submit(0, lambda: done.append(("0b", True)))
        assert done == []  # queued, not run inline
        release.set()
        writes.settle(0)
        assert done == [("0a", True), ("1", True), ("0b", True)]
    finally:
        writes.close()


def test_a_failure_is_raised_by_the_settle_of_its_layer_only():
    writes = BackgroundWrites()
    try:
        writes.submit(2, lambda: 1 / 0)
        writes.submit(3, lambda: None)
        writes.settle(3)
        with pytest.raises(ZeroDivisionError):
            writes.settle(2)
    finally:
        writes.close()
