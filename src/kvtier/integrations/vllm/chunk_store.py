"""Fixed-size KV chunks in HiFC's append-only flash log, found by key, verified on every read.

`FlashChunkStore` is the engine-independent core of the vLLM tier: `store(keys, buffers)` appends
the chunks at the log head (FlashLog: consecutive slots, one pwritev per run straight from the
caller's page-aligned buffers, spread over the IOEngine's threads, O_DIRECT where allowed);
`load(keys, buffers)` reads them back and checks each against the crc32c recorded when it was
stored; a chunk that does not match is reported failed and forgotten, never handed over. Both
return futures at once: the I/O and the checks run on the engine's threads.

When the head reaches a segment that still holds live chunks, that segment (the oldest) is
reclaimed: its chunks are dropped from the index (later lookups miss; vLLM recomputes them) and a
RECLAIM record goes to the journal before anything overwrites them. A segment with a chunk still
being read or written is never reclaimed; the store fails instead, and vLLM keeps the chunk in
its CPU tier. A completed store journals its PUT records, then makes the chunks visible.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, StorageError
from kvtier.integrations.vllm.chunk_index import ChunkIndex, Entry
from kvtier.integrations.vllm.flash_file import FlashFile
from kvtier.integrations.vllm.journal import Journal, put, reclaim
from kvtier.storage import PAGE, IOEngine, checksum
from kvtier.storage.flash_log import DEFAULT_SEGMENT_SLOTS, FlashFullError, FlashLog
from kvtier.storage.io_engine import consecutive_spans

# One pwritev/preadv moves at most this much, so a job's chunks spread over the I/O threads.
RUN_BYTES = 1 << 20
# The journal is compacted once it holds this many records per slot (plus a little): bounded restarts.
COMPACT_RECORDS_PER_SLOT = 2


@dataclass
class LoadOutcome:
    """Keys whose bytes were read and verified, and why the others were not handed over."""

    loaded: list[bytes] = field(default_factory=list)
    failed: dict[bytes, str] = field(default_factory=dict)


class FlashChunkStore:
    """One flash file of `chunk_bytes` chunks plus its journal (`<path>.index`)."""

    def __init__(self, path: str | Path, chunk_bytes: int, capacity_bytes: int, identity: dict[str, Any],
                 io_threads: int = 16, segment_chunks: int = DEFAULT_SEGMENT_SLOTS, fsync: bool = False) -> None:
        if chunk_bytes <= 0 or chunk_bytes % PAGE:
            raise ConfigError(f"flash tier chunks must be a positive multiple of {PAGE} bytes for O_DIRECT, "
                              f"got {chunk_bytes}")
        started = time.perf_counter()
        path = Path(path)
        self.file = FlashFile.open_or_create(path, chunk_bytes, capacity_bytes, identity)
        self.journal: Journal | None = None
        try:
            self.journal = Journal(path.with_name(path.name + ".index"), self.file.file_id, fsync)
            replayed = ChunkIndex.replay(self.journal.records, self.file.num_slots)
            self.journal.records = None  # replayed: let it go
            self.index, self._seq = replayed.index, replayed.next_seq
            self.log = FlashLog(self.file.num_slots, min(segment_chunks, self.file.num_slots))
            self.log.resume(live=self.index.slots(), written=replayed.written, head=replayed.head)
        except BaseException:
            if self.journal is not None:
                self.journal.close()
            self.file.close()
            raise
        self._lock = threading.Lock()
        self._maybe_compact()
        self.io = IOEngine(io_threads)
        self._pins: Counter[int] = Counter()  # slots being read or written
        self._pending: set[bytes] = set()  # keys being stored
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)
        self.counts = Counter(recovered_chunks=len(self.index))
        self.recovery_s = time.perf_counter() - started

    @property
    def chunk_bytes(self) -> int:
        return self.file.chunk_bytes

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def store(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> Future[list[bytes]]:
        """Append the chunks not stored yet; the future gives the keys written (or the I/O error)."""
        with self._lock:
            chosen = [(key, buffer) for key, buffer in zip(keys, buffers) if key not in self.index
                      and key not in self._pending]
            chosen = list(dict((key, buffer) for key, buffer in chosen).items())  # a key twice in one job
            if not chosen:
                return _done([])
            try:
                slots = self._allocate(len(chosen))
            except StorageError as error:  # full (FlashFullError), or the journal could not be written
                return _failed(error)
            seqs = list(range(self._seq, self._seq + len(slots)))
            self._seq += len(slots)
            self._pending.update(key for key, _ in chosen)
            self._pin(slots)
        written = self._submit(self.io.submit_write_runs, self._runs(slots, [buffer for _, buffer in chosen]))
        return _after(written, lambda error: self._finish_store(error, chosen, slots, seqs))

    def load(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> Future[LoadOutcome]:
        """Read the chunks into `buffers` and verify each; the future says which were handed over."""
        outcome = LoadOutcome()
        wanted: list[tuple[bytes, Entry, Any]] = []
        with self._lock:
            for key, buffer in zip(keys, buffers):
                entry = self.index.get(key)
                if entry is None:
                    outcome.failed[key] = "not in the flash tier"
                else:
                    wanted.append((key, entry, buffer))
            self._pin([entry.slot for _, entry, _ in wanted])
        if not wanted:
            return _done(outcome)
        wanted.sort(key=lambda item: item[1].slot)
        slots = [entry.slot for _, entry, _ in wanted]
        read = self._submit(self.io.submit_read_runs, self._runs(slots, [buffer for _, _, buffer in wanted]))
        return _after(read, lambda error: self._finish_load(error, wanted, outcome))

    def drain(self) -> None:
        """Wait until no store or load is in flight."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0)

    def stats(self) -> dict[str, Any]:
        return dict(self.counts) | {
            "chunks": len(self.index), "capacity_chunks": self.file.num_slots, "chunk_bytes": self.chunk_bytes,
            "appends": self.log.appends, "sequential_appends": self.log.sequential_appends,
            "sequential_share": self.log.sequential_share, "overwrites": self.log.overwrites,
            "reclaimed_segments": self.log.reclaimed_segments, "journal_records": self.journal.count,
            "journal_torn_bytes_dropped": self.journal.dropped_bytes, "recovery_s": self.recovery_s,
            "direct": self.file.direct, "bytes_written": self.io.stats.bytes_written,
            "bytes_read": self.io.stats.bytes_read,
        }

    def close(self) -> None:
        self.drain()
        self.io.close()
        with self._lock:
            self._maybe_compact()
        self.journal.close()
        self.file.close()

    def _submit(self, submit: Callable[[int, list[Any]], Future[None]], runs: list[Any]) -> Future[None]:
        """The I/O engine's future for `runs`, or a failed one (a bad buffer, an engine shut down): the
        finishing step then releases what the job holds."""
        try:
            return submit(self.file.fd, runs)
        except Exception as error:
            return _failed(error)

    def _allocate(self, n: int) -> list[int]:
        """`n` slots at the head, reclaiming the oldest segments that stand in the way (lock held)."""
        reclaims = []
        try:
            return self._allocate_reclaiming(n, reclaims)
        finally:
            self.journal.append(reclaims)  # before anything overwrites the dropped chunks

    def _allocate_reclaiming(self, n: int, reclaims: list[Any]) -> list[int]:
        while self.log.free_slots < n:
            segment = self.log.blocking_segment()
            if segment is None:
                raise FlashFullError(f"{n} chunks do not fit the {self.file.num_slots}-chunk flash tier at once")
            slots = [slot for slot in self.log.segment_range(segment) if self.log.is_live(slot)]
            if any(self._pins[slot] for slot in slots):
                raise FlashFullError(f"the flash tier's oldest segment ({segment}) is still being read or written; "
                                     "chunks not stored")
            self.counts["dropped_chunks"] += len(self.index.drop_slots(slots))
            self.log.free(slots)
            span = self.log.segment_range(segment)
            reclaims.append(reclaim(self._seq, span.start, len(span)))
            self._seq += 1
        return self.log.allocate(n)

    def _runs(self, slots: list[int], buffers: list[Any]) -> list[tuple[int, list[memoryview]]]:
        """(offset, buffers) runs of consecutive slots, at most RUN_BYTES each."""
        per_run = max(1, RUN_BYTES // self.file.slot_bytes)
        runs = []
        for span in consecutive_spans(slots):
            for start in range(span.start, span.stop, per_run):
                stop = min(start + per_run, span.stop)
                runs.append((self.file.offset(slots[start]), [memoryview(buffer) for buffer in buffers[start:stop]]))
        return runs

    def _finish_store(self, error: BaseException | None, chosen: list[tuple[bytes, Any]], slots: list[int],
                      seqs: list[int]) -> list[bytes]:
        """Journal and publish a written job (an I/O thread); on failure its slots turn stale."""
        entries = [] if error else [(key, Entry(slot, checksum(buffer), seq))
                                    for (key, buffer), slot, seq in zip(chosen, slots, seqs)]
        if entries and self.journal.fsync:
            error = _fdatasync(self.file.fd)  # the chunks are durable before a record says they are there
        with self._lock:
            try:
                if error is not None:
                    raise error
                self.journal.append([put(entry.seq, entry.slot, entry.crc, key) for key, entry in entries])
            except BaseException:
                self.log.free(slots)
                raise
            finally:
                self._pending.difference_update(key for key, _ in chosen)
                self._unpin_locked(slots)
            for key, entry in entries:
                self.index.add(key, entry)
            self.counts["stored_chunks"] += len(entries)
            self._maybe_compact()
            return [key for key, _ in entries]

    def _finish_load(self, error: BaseException | None, wanted: list[tuple[bytes, Entry, Any]],
                     outcome: LoadOutcome) -> LoadOutcome:
        """Verify every chunk read (an I/O thread); a mismatching one is reported and forgotten."""
        try:
            if error is not None:
                raise error
            bad = []
            for key, entry, buffer in wanted:
                found = checksum(buffer)
                if found == entry.crc:
                    outcome.loaded.append(key)
                    continue
                bad.append((key, entry))
                outcome.failed[key] = (f"checksum mismatch in {self.file.path} slot {entry.slot} "
                                       f"(stored 0x{entry.crc:08x}, read 0x{found:08x})")
            self.counts["loaded_chunks"] += len(outcome.loaded)
            if bad:
                self._forget(bad)
            return outcome
        finally:
            self._unpin([entry.slot for _, entry, _ in wanted])

    def _forget(self, bad: list[tuple[bytes, Entry]]) -> None:
        with self._lock:
            self.counts["checksum_failures"] += len(bad)
            for key, entry in bad:
                if self.index.get(key) == entry:
                    self.index.remove(key)
                    self.log.free([entry.slot])

    def _pin(self, slots: list[int]) -> None:
        self._pins.update(slots)
        self._in_flight += 1

    def _unpin(self, slots: list[int]) -> None:
        with self._lock:
            self._unpin_locked(slots)

    def _unpin_locked(self, slots: list[int]) -> None:
        self._pins.subtract(slots)
        self._in_flight -= 1
        self._idle.notify_all()

    def _maybe_compact(self) -> None:
        """Rewrite the journal to the live entries once it is long enough to slow a restart (lock held)."""
        if self.journal.count > COMPACT_RECORDS_PER_SLOT * self.file.num_slots + 1024:
            self.journal.rewrite(self.index.records(self.log.head, self._seq))
            self._seq += 1


def _after(future: Future[Any], step: Callable[[BaseException | None], Any]) -> Future[Any]:
    """A future for `step(error of future, or None)`, run once `future` is done; an error in step fails it."""
    chained: Future[Any] = Future()

    def on_done(done: Future[Any]) -> None:
        try:
            chained.set_result(step(done.exception()))
        except BaseException as step_error:  # delivered to whoever polls the future
            chained.set_exception(step_error)

    future.add_done_callback(on_done)
    return chained


def _fdatasync(fd: int) -> OSError | None:
    try:
        os.fdatasync(fd)
    except OSError as error:
        return error
    return None


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _failed(error: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(error)
    return future
