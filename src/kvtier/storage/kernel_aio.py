"""Scattered reads through Linux kernel AIO: every read of a batch submitted in one syscall, one wait for all.

A sparse fetch is tens to hundreds of scattered 4 KiB-aligned runs per layer and
step. Through the thread pool each run costs a Python-level hand-off and a GIL
round trip when it completes; on the 2-core VM those, not the disk, bounded the
fetch. With O_DIRECT, kernel AIO (`io_submit`) queues every
run at the device at once and `io_getevents` waits for all of them: no Python
work per run, the queue depth the SSD wants. The control blocks are built as a
numpy structured array, so a batch costs a handful of Python operations
whatever its size.

Called through ctypes on the syscall numbers (x86_64, aarch64), so nothing is
compiled or installed. `KernelAio.open()` returns None where AIO cannot be
had (another architecture, a sandbox that forbids it, the system's AIO limit
reached); callers then use the thread pool. Without O_DIRECT, `io_submit`
runs the reads synchronously: correct, just not overlapped.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform

import numpy as np

log = logging.getLogger(__name__)

# (io_setup, io_destroy, io_getevents, io_submit) per machine
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_IOCB_CMD_PREAD = 0
MAX_EVENTS = 1024

IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<i4"), ("opcode", "<u2"), ("reqprio", "<i2"),
                 ("fildes", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"), ("offset", "<i8"), ("reserved2", "<u8"),
                 ("flags", "<u4"), ("resfd", "<u4")])  # struct iocb, little endian
EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])  # struct io_event


class ReadFailed(Exception):
    """One read of a batch failed (`error` an OSError) or came back short (`error` None, `moved` < `wanted`)."""

    def __init__(self, offset: int, wanted: int, moved: int, error: OSError | None) -> None:
        super().__init__(f"read of {wanted} bytes at offset {offset} failed")
        self.offset, self.wanted, self.moved, self.error = offset, wanted, moved, error


class KernelAio:
    """One kernel AIO context; `submit` queues a batch of (file offset, length, buffer address) reads."""

    def __init__(self, libc: ctypes.CDLL, numbers: tuple[int, int, int, int], context: ctypes.c_ulong) -> None:
        self._libc = libc
        _, self._destroy, self._getevents, self._submit = numbers  # io_setup was called by `open`
        self._context = context

    @classmethod
    def open(cls) -> KernelAio | None:
        """A new context, or None where kernel AIO is not available (callers fall back to threads)."""
        numbers = _SYSCALLS.get(platform.machine())
        if numbers is None or platform.system() != "Linux":
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        context = ctypes.c_ulong(0)
        if libc.syscall(ctypes.c_long(numbers[0]), ctypes.c_long(MAX_EVENTS), ctypes.byref(context)) != 0:
            log.info("kernel AIO unavailable (%s); scattered reads use the thread pool",
                     os.strerror(ctypes.get_errno()))
            return None
        return cls(libc, numbers, context)

    def submit(self, fd: int, offsets: np.ndarray, lengths: np.ndarray, addresses: np.ndarray) -> AioBatch:
        """Queue reads of `lengths[i]` bytes at file offset `offsets[i]` into memory at `addresses[i]` and return
        at once; `wait()` on the result (the bytes read, or ReadFailed) before touching the buffers.

        One batch per context may be in flight at a time (its completions are reaped by count).
        """
        blocks = np.zeros(len(offsets), dtype=IOCB)
        blocks["data"] = np.arange(len(offsets))
        blocks["opcode"] = _IOCB_CMD_PREAD
        blocks["fildes"] = fd
        blocks["buf"], blocks["nbytes"], blocks["offset"] = addresses, lengths, offsets
        pointers = blocks.ctypes.data + np.arange(len(offsets), dtype=np.uint64) * IOCB.itemsize
        batch = AioBatch(self, blocks, pointers)
        submitted = 0
        while submitted < len(blocks):  # the kernel may take fewer than asked
            taken = self._syscall(self._submit, self._context, ctypes.c_long(min(len(blocks) - submitted, MAX_EVENTS)),
                                  ctypes.c_void_p(pointers.ctypes.data + 8 * submitted))
            if taken < 0:
                batch.count = submitted
                batch.failure = ReadFailed(int(offsets[submitted]), int(lengths[submitted]), 0, _os_error(-taken))
                return batch
            submitted += taken
            if submitted < len(blocks):  # the queue is full: make room before queueing more
                batch.reap(min(submitted - batch.reaped, len(blocks) - submitted))
        return batch

    def _reap(self, count: int) -> np.ndarray:
        """`count` completions (their events, in completion order)."""
        events = np.zeros(count, dtype=EVENT)
        got = 0
        while got < count:
            reaped = self._syscall(self._getevents, self._context, ctypes.c_long(count - got),
                                   ctypes.c_long(count - got), ctypes.c_void_p(events.ctypes.data + got * EVENT.itemsize),
                                   None)
            if reaped < 0:
                if -reaped == errno.EINTR:
                    continue
                raise _os_error(-reaped)
            got += reaped
        return events

    def _syscall(self, number: int, *args) -> int:
        result = self._libc.syscall(ctypes.c_long(number), *args)
        return -ctypes.get_errno() if result < 0 else result

    def close(self) -> None:
        if self._context.value:
            self._syscall(self._destroy, self._context)
            self._context = ctypes.c_ulong(0)


class AioBatch:
    """Reads queued by `KernelAio.submit`; their control blocks live here until `wait` has reaped them all."""

    def __init__(self, aio: KernelAio, blocks: np.ndarray, pointers: np.ndarray) -> None:
        self.aio, self.blocks, self.pointers = aio, blocks, pointers
        self.count = len(blocks)  # reads the kernel took
        self.reaped = 0
        self.failure: ReadFailed | None = None
        self._events: list[np.ndarray] = []

    def reap(self, count: int) -> None:
        self._events.append(self.aio._reap(count))
        self.reaped += count

    def wait(self) -> int:
        """Block until every queued read is done; the bytes read, or ReadFailed for the first bad read."""
        if self.reaped < self.count:
            self.reap(self.count - self.reaped)
        if self.failure is not None:
            raise self.failure
        events = np.concatenate(self._events) if self._events else np.zeros(0, dtype=EVENT)
        wanted = self.blocks["nbytes"][events["data"].astype(np.int64)].astype(np.int64)
        bad = np.flatnonzero(events["res"] != wanted)
        if bad.size:
            index, result = int(events["data"][bad[0]]), int(events["res"][bad[0]])
            raise ReadFailed(int(self.blocks["offset"][index]), int(wanted[bad[0]]), max(result, 0),
                             _os_error(-result) if result < 0 else None)
        return int(wanted.sum())


def _os_error(code: int) -> OSError:
    return OSError(code, os.strerror(code))
