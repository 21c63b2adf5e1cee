"""One writer per file: the lock names its holder, dies with it, and leaves nothing behind once released."""

import os
import subprocess
import sys

import pytest

from kvtier.errors import StorageError
from kvtier.storage.file_lock import FileInUseError, FileLock

HOLD = ("import sys, time; from kvtier.storage.file_lock import FileLock; FileLock.acquire(sys.argv[1]); "
        "print('held', flush=True); time.sleep(60)")


@pytest.fixture
def holder(tmp_path):
    """A process holding the lock of tmp_path/data until the test ends."""
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "data")], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        yield child
    finally:
        child.kill()
        child.wait()


def test_the_lock_file_names_the_holder_and_release_deletes_it(tmp_path):
    lock = FileLock.acquire(tmp_path / "data")
    assert (tmp_path / "data.lock").read_text() == f"{os.getpid()}\n"
    lock.release()
    lock.release()  # twice is harmless
    assert list(tmp_path.iterdir()) == []


def test_another_process_is_refused_with_the_holders_pid(tmp_path, holder):
    with pytest.raises(FileInUseError) as refused:
        FileLock.acquire(tmp_path / "data", "flash cache file")
    assert str(refused.value) == (f"flash cache file {tmp_path / 'data'} is in use by kvtier process {holder.pid}; "
                                  "stop it or give this run another path")


def test_a_second_open_in_the_same_process_is_refused_too(tmp_path):
    lock = FileLock.acquire(tmp_path / "data")
    try:
        with pytest.raises(FileInUseError, match=f"in use by kvtier process {os.getpid()}"):
            FileLock.acquire(tmp_path / "data")
    finally:
        lock.release()


def test_the_lock_of_a_killed_holder_is_taken_over(tmp_path, holder):
    holder.kill()
    holder.wait()
    assert (tmp_path / "data.lock").exists()  # SIGKILL ran no clean-up, but the kernel dropped the flock
    lock = FileLock.acquire(tmp_path / "data")
    assert (tmp_path / "data.lock").read_text() == f"{os.getpid()}\n"
    lock.release()


def test_a_missing_directory_is_a_storage_error(tmp_path):
    with pytest.raises(StorageError, match=f"{tmp_path / 'missing' / 'data'}: cannot create its lock file"):
        FileLock.acquire(tmp_path / "missing" / "data")
