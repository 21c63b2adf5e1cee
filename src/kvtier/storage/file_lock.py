"""One writer per file: an advisory lock (flock) on a sidecar `<file>.lock` that names its holder's pid.

Every file kvtier writes to (flash swap files, offload and cold-pool KV files, the vLLM tier's journal,
document store entries being written) is taken with `FileLock.acquire` before it is opened for writing,
and so before any truncation, resize or replacement: a second process asking for the same path gets a
one-line `FileInUseError` naming the holder's pid, and the holder's file is left as it was.

Why a sidecar and not the data file's own header: the lock must outlive the data file's replacement
(a flash cache of another geometry is deleted and created anew, a compacted journal is renamed over
the old one, an entry is written under a temporary name), several of these files have no header
(record files, journals, kv.bin), and the pid is read without parsing any format.

The kernel drops a flock when its holder exits, even on SIGKILL: a lock file left by a crash is not
held, and the next writer takes it over. `release` deletes the lock file while still holding the
lock; a writer that opened the old lock file meanwhile sees, once it holds the lock, that the path
names another file (or none) and starts again, so two writers never both hold "the" lock.
"""

from __future__ import annotations

import fcntl
import os

from kvtier.errors import StorageError

SUFFIX = ".lock"


class FileInUseError(StorageError):
    """The file is being written by another process (or by another open in this one)."""


class FileLock:
    """The held lock of one data file; `release` (or closing the data file's owner) gives it up."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path  # the lock file
        self._fd = fd

    @classmethod
    def acquire(cls, target: str | os.PathLike[str], what: str = "file") -> FileLock:
        """The lock of `target` (the data file, which need not exist yet), with this process's pid written in it.

        Raises FileInUseError naming the holder's pid when another process (or another open in this one) holds it,
        StorageError when the lock file cannot be created (a missing or read-only directory).
        """
        path = os.fspath(target) + SUFFIX
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as error:
                raise StorageError(f"{os.fspath(target)}: cannot create its lock file: {error.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise FileInUseError(f"{what} {os.fspath(target)} is in use by {holder}; stop it or give this run "
                                     "another path") from None
            if _still_named(fd, path):
                break
            os.close(fd)  # released and deleted by its holder while we waited for it: take the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Delete the lock file and give up the lock (idempotent)."""
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass  # removed by hand: nothing else to clean up
        os.close(self._fd)
        self._fd = -1


def _holder(fd: int) -> str:
    """Who holds the lock: the pid it wrote, if it has written it yet."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return f"kvtier process {text}" if text.isdigit() else "another kvtier process"


def _still_named(fd: int, path: str) -> bool:
    """Whether `path` is still the file open at `fd` (not deleted, nor replaced by a newer lock file)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
