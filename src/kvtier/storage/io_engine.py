"""Parallel positional vectored I/O: many `preadv`/`pwritev` calls spread over a thread pool.

A *run* is (file offset, buffers): buffers laid back to back on disk starting
at the offset, moved by one vectored syscall. Python threads release the GIL
inside `os.preadv`/`os.pwritev`, so a pool of threads keeps several requests in
flight at the SSD, which is what random reads need to approach its bandwidth.
Runs are dealt round-robin into one group per thread and each thread works
through its group: a sparse fetch of a few hundred scattered pages is one
task hand-off per thread, not one per page (223 random 4 KiB pages x 30
layers, 8 threads, on the development VM: 1.4-2.9 s with a task per run,
1.05-1.29 s with a task per thread, two trials each).
The synchronous calls work through the first group in the calling thread, so
a single run costs no thread hand-off.

`submit_scattered` (many small reads into one buffer: the sparse path's cold
fetch) and `read_runs_batched` (the selective baselines' page reads) go through
kernel AIO (kernel_aio.py) where available, every read queued at once with no
Python work per read, and through the threads otherwise.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from kvtier.errors import ConfigError, StorageError
from kvtier.storage.kernel_aio import KernelAio, ReadFailed

Run = tuple[int, Sequence[memoryview]]
T = TypeVar("T")

_COUNTERS = ("bytes_read", "bytes_written", "read_calls", "write_calls", "bounce_copies")
try:
    IOV_MAX = os.sysconf("SC_IOV_MAX")
except (ValueError, OSError):  # not reported by this libc: POSIX minimum on Linux
    IOV_MAX = 1024
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@dataclass
class IOStats:
    """Bytes and syscalls moved by an engine; `bounce_copies` counts blocks copied through aligned buffers."""

    bytes_read: int = 0
    bytes_written: int = 0
    read_calls: int = 0
    write_calls: int = 0
    bounce_copies: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        """Add to the named counters atomically (called from I/O threads)."""
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> IOStats:
        """A consistent copy of the counters."""
        with self._lock:
            return IOStats(**{name: getattr(self, name) for name in _COUNTERS})

    def minus(self, earlier: IOStats) -> IOStats:
        """Counters moved since `earlier` (a previous snapshot)."""
        return IOStats(**{name: getattr(self, name) - getattr(earlier, name) for name in _COUNTERS})


class IOEngine:
    """A thread pool that moves runs of buffers to and from file descriptors."""

    def __init__(self, threads: int = 8) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"I/O threads must be a positive integer, got {threads!r}")
        self.threads = threads
        self.stats = IOStats()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtier-io")
        self._aio: KernelAio | None | bool = False  # opened on first use; None where unavailable
        self._aio_lock = threading.Lock()

    @property
    def backend(self) -> str:
        """What scattered reads go through: "kernel-aio" or "threads" (recorded in benchmark results)."""
        return "kernel-aio" if self._kernel_aio() is not None else "threads"

    def read_runs(self, fd: int, runs: Sequence[Run]) -> None:
        """Fill every run's buffers from the file, one preadv per run (split only past IOV_MAX)."""
        self._run_all(self._read_run, fd, runs)

    def write_runs(self, fd: int, runs: Sequence[Run]) -> None:
        """Write every run's buffers to the file, one pwritev per run (split only past IOV_MAX)."""
        self._run_all(self._write_run, fd, runs)

    def submit_read_runs(self, fd: int, runs: Sequence[Run]) -> Future[None]:
        """`read_runs` in the background; the future completes when every run is done."""
        return gather([self._pool.submit(_each, self._read_run, fd, group) for group in self._groups(runs)])

    def submit_write_runs(self, fd: int, runs: Sequence[Run]) -> Future[None]:
        """`write_runs` in the background; the future completes when every run is done."""
        return gather([self._pool.submit(_each, self._write_run, fd, group) for group in self._groups(runs)])

    def submit_scattered(self, fd: int, offsets: np.ndarray, lengths: np.ndarray, buffer: np.ndarray,
                         buffer_offsets: np.ndarray) -> ScatteredRead:
        """Queue reads of `lengths[i]` bytes at file offset `offsets[i]` into `buffer[buffer_offsets[i]:]`, for
        every i; call `wait()` on the result before using `buffer`.

        Through kernel AIO one batch per engine is in flight at a time: a second submission waits
        until the first has been waited for. The `io_submit` call itself runs on a pool thread: with
        O_DIRECT it passes every read down to the block device before returning, a few hundred
        microseconds per layer on the development VM that the caller spends on its own work instead.
        """
        if len(offsets) and (buffer_offsets + lengths).max() > buffer.nbytes:
            raise ValueError("scattered read runs past the end of its buffer")
        aio = self._kernel_aio()
        if aio is None or not len(offsets):
            runs = [(int(offset), [memoryview(buffer[start : start + length])])
                    for offset, length, start in zip(offsets.tolist(), lengths.tolist(), buffer_offsets.tolist())]
            return ScatteredRead(self, fd, future=self.submit_read_runs(fd, runs))
        addresses = buffer.ctypes.data + buffer_offsets.astype(np.uint64)
        self._aio_lock.acquire()  # released by ScatteredRead.wait
        try:
            queued = self._pool.submit(aio.submit, fd, offsets, lengths, addresses)
        except BaseException:  # e.g. the engine closed: nothing was queued, so nothing will wait
            self._aio_lock.release()
            raise
        return ScatteredRead(self, fd, queued=queued, buffer=buffer)

    def read_runs_batched(self, fd: int, runs: Sequence[Run]) -> None:
        """`read_runs` for many small single-buffer runs: one kernel AIO batch where available (as the sparse
        path's cold fetch reads), the threads otherwise."""
        aio = self._kernel_aio()
        if aio is None or not runs or any(len(buffers) != 1 for _, buffers in runs):
            self.read_runs(fd, runs)
            return
        views = [np.frombuffer(buffers[0], dtype=np.uint8) for _, buffers in runs]
        offsets = np.array([offset for offset, _ in runs], dtype=np.int64)
        lengths = np.array([view.nbytes for view in views], dtype=np.int64)
        addresses = np.array([view.ctypes.data for view in views], dtype=np.uint64)
        self._aio_lock.acquire()  # released by ScatteredRead.wait
        try:
            batch = aio.submit(fd, offsets, lengths, addresses)
        except BaseException:
            self._aio_lock.release()
            raise
        ScatteredRead(self, fd, batch=batch, buffer=views).wait()

    def _kernel_aio(self) -> KernelAio | None:
        if self._aio is False:
            self._aio = KernelAio.open()
        return self._aio

    def close(self) -> None:
        """Wait for queued I/O, then stop the threads."""
        self._pool.shutdown(wait=True)
        if self._aio:
            self._aio.close()
            self._aio = None

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run_all(self, transfer: Callable[[int, int, Sequence[memoryview]], None], fd: int,
                 runs: Sequence[Run]) -> None:
        groups = self._groups(runs)
        if not groups:
            return
        others = [self._pool.submit(_each, transfer, fd, group) for group in groups[1:]]
        try:
            _each(transfer, fd, groups[0])
        finally:
            # Never return while a thread may still be filling or reading a caller's buffer.
            wait(others)
        for future in others:
            future.result()

    def _groups(self, runs: Sequence[Run]) -> list[Sequence[Run]]:
        """Runs dealt round-robin into at most one group per thread (similar sizes when runs are similar)."""
        return [runs[first :: self.threads] for first in range(min(self.threads, len(runs)))]

    def _read_run(self, fd: int, offset: int, buffers: Sequence[memoryview]) -> None:
        self._transfer(os.preadv, "read", fd, offset, buffers)

    def _write_run(self, fd: int, offset: int, buffers: Sequence[memoryview]) -> None:
        self._transfer(os.pwritev, "write", fd, offset, buffers)

    def _transfer(self, syscall: Callable[[int, Any, int], int], verb: str, fd: int, offset: int,
                  buffers: Sequence[memoryview]) -> None:
        pending = [memoryview(buffer).cast("B") for buffer in buffers]
        pending = [view for view in pending if view.nbytes]
        while pending:
            try:
                moved = syscall(fd, pending[:IOV_MAX], offset)
            except OSError as error:
                raise _storage_error(error, verb, fd, offset) from error
            if moved == 0:
                raise _truncated(fd, offset, verb, sum(view.nbytes for view in pending))
            if verb == "read":
                self.stats.add(bytes_read=moved, read_calls=1)
            else:
                self.stats.add(bytes_written=moved, write_calls=1)
            offset += moved
            pending = _advance(pending, moved)


class ScatteredRead:
    """Reads in flight from `IOEngine.submit_scattered` (kernel AIO batch or thread-pool future)."""

    def __init__(self, engine: IOEngine, fd: int, future: Future[None] | None = None, batch=None,
                 queued: Future | None = None, buffer=None) -> None:
        """`future`: thread-pool reads; `batch`: a kernel AIO batch, or `queued`: one being submitted (the engine's
        AIO lock is held for either until `wait`)."""
        self.engine, self.fd, self.future, self.batch, self.queued = engine, fd, future, batch, queued
        self.buffer = buffer  # kept alive while the kernel writes into it

    def wait(self) -> None:
        """Block until every read is done; StorageError for a failed or short read."""
        if self.future is not None:
            self.future.result()
            return
        if self.batch is None and self.queued is None:
            return  # waited for already
        batch, queued, self.batch, self.queued = self.batch, self.queued, None, None
        try:
            if batch is None:
                batch = queued.result()
            moved = batch.wait()
        except ReadFailed as failed:
            if failed.error is not None:
                raise _storage_error(failed.error, "read", self.fd, failed.offset) from failed.error
            raise _truncated(self.fd, failed.offset, "read", failed.wanted - failed.moved) from None
        finally:
            self.engine._aio_lock.release()
        self.engine.stats.add(bytes_read=moved, read_calls=batch.count)


def _each(transfer: Callable[[int, int, Sequence[memoryview]], None], fd: int, runs: Sequence[Run]) -> None:
    """Move one group of runs, one after the other (inside one pool thread)."""
    for offset, buffers in runs:
        transfer(fd, offset, buffers)


def _advance(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """The part of `views` left after the first `nbytes` bytes were transferred (short read/write)."""
    for index, view in enumerate(views):
        if nbytes < view.nbytes:
            return [view[nbytes:], *views[index + 1:]]
        nbytes -= view.nbytes
    return []


def fd_name(fd: int) -> str:
    """The path an open file descriptor refers to, for error messages."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"file descriptor {fd}"


def _truncated(fd: int, offset: int, verb: str, remaining: int) -> StorageError:
    return StorageError(f"{fd_name(fd)}: unexpected end of file at offset {offset} while trying to {verb} "
                        f"{remaining} more bytes; the file is truncated")


def _storage_error(error: OSError, verb: str, fd: int, offset: int) -> StorageError:
    name = fd_name(fd)
    if error.errno in _NO_SPACE:
        return StorageError(f"{name}: no space left on the device while writing at offset {offset}; "
                            f"free space in {os.path.dirname(name) or '.'} or use a smaller storage budget")
    return StorageError(f"{name}: {verb} failed at offset {offset}: {error.strerror}")


def gather(futures: Iterable[Future[Any]]) -> Future[None]:
    """A future that completes when all `futures` have, failing with the first error among them."""
    futures = list(futures)
    combined: Future[None] = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def on_done(_: Future[Any]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        # Only report once all are finished, so no buffer is still in use when the caller sees an error.
        errors = [future.exception() for future in futures if future.exception() is not None]
        if errors:
            combined.set_exception(errors[0])
        else:
            combined.set_result(None)

    if not futures:
        combined.set_result(None)
    for future in futures:
        future.add_done_callback(on_done)
    return combined


def then(future: Future[Any], step: Callable[[], T]) -> Future[T]:
    """A future for `step()` run once `future` succeeded; either's error becomes the new future's error."""
    chained: Future[T] = Future()

    def on_done(done: Future[Any]) -> None:
        error = done.exception()
        if error is not None:
            chained.set_exception(error)
            return
        try:
            chained.set_result(step())
        except BaseException as step_error:  # delivered to whoever waits on the future
            chained.set_exception(step_error)

    future.add_done_callback(on_done)
    return chained


def consecutive_spans(numbers: Sequence[int]) -> list[slice]:
    """Slices of sorted `numbers` within which each number is one more than the one before.

    Used to coalesce blocks (or pages) that are adjacent on disk into one run.
    """
    spans: list[slice] = []
    start = 0
    for index in range(1, len(numbers) + 1):
        if index == len(numbers) or numbers[index] != numbers[index - 1] + 1:
            spans.append(slice(start, index))
            start = index
    return spans
