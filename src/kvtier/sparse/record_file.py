"""A file of fixed-size token records in page-aligned regions: the cold pool's on-disk layout.

The cold pool stores per-token records (a token's full-precision K|V of one
layer, or its key sketch), because selection is per token. Records are packed
back to back, without padding, inside one region per (layer, sequence); every
region starts on a 4 KiB page so that a region prefix is one large O_DIRECT
read (what the scorer streams) and a run of adjacent slots shares pages (what
keeps fetches of neighbouring tokens cheap).

    offset(layer, seq, slot) = ((layer * batch) + seq) * region_stride + slot * record_bytes

Writes move whole 4 KiB pages (the disks' physical sector), so writing records
that share a page with others reads that page first (read-modify-write).
Writes of slot runs only read the two edge pages of each run. A fetch of
scattered records reads the file's read units holding them, its *pages*: 512-byte
sectors where O_DIRECT takes them (direct_file.direct_read_unit), else 4 KiB;
short gaps bridged (storage/pages.py). Records of 1-1.5 KiB fill whole sectors,
so a fetch reads what it asked for, not the 4 KiB around each record.

With `page_checksums`, the file keeps a crc32c of every page it wrote (in its
own memory, or in shared memory where another process reads the file too) and
checks every page it reads against it (fetches and the edge pages
of a read-modify-write alike), all pages of a read in one compiled call
(kernels/crc32c_units.c), not one Python call per record or page. Both
cold-pool files keep them; a stored image persists them (cold_image.py), so a
file opened read-only with `stored_pages` is checked by another process too
(the scorer checks a stored image's sketches the same way).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.errors import ChecksumError, StorageError
from kvtier.storage import PAGE, IOEngine, aligned_buffer, direct_read_unit, drop_page_cache, open_direct, round_up
from kvtier.storage.checksum import PageChecksums
from kvtier.storage.file_lock import FileLock
from kvtier.storage.io_engine import consecutive_spans
from kvtier.storage.pages import page_runs, ranges
from kvtier.units import format_size


@dataclass(frozen=True)
class RecordLayout:
    """Where record `slot` of (layer, seq) lives in the file."""

    record_bytes: int
    layers: int
    batch: int
    slots: int  # capacity of one region, in records

    @property
    def region_stride(self) -> int:
        return round_up(self.slots * self.record_bytes, PAGE)

    @property
    def file_bytes(self) -> int:
        return self.layers * self.batch * self.region_stride

    def region_offset(self, layer: int, seq: int) -> int:
        return (layer * self.batch + seq) * self.region_stride

    def prefix_bytes(self, count: int) -> int:
        """Bytes to read (whole pages) to cover records 0..count-1 of a region."""
        return round_up(count * self.record_bytes, PAGE)

    def to_dict(self) -> dict[str, int]:
        return {"record_bytes": self.record_bytes, "layers": self.layers, "batch": self.batch, "slots": self.slots}


class RecordFile:
    """Read and write records of one RecordLayout through an IOEngine (O_DIRECT where the FS allows)."""

    def __init__(self, path: str, layout: RecordLayout, io: IOEngine, create: bool = True,
                 page_checksums: Callable[[int, int], PageChecksums] | None = None,
                 stored_pages: PageChecksums | None = None) -> None:
        """`page_checksums`: makes the table of its pages' crcs (given their count and size), e.g. `PageChecksums`.
        `stored_pages`: open read-only a file another process wrote (a stored cold-pool image, or the run's own K|V
        file in the scorer), every page read checked against these crcs; it is never written through, so several
        processes may read it at once."""
        self.path = path
        self.layout = layout
        self.io = io
        self._read_buffer = aligned_buffer(0)  # reused by fetches (result() copies out); grown on demand
        self._reading = False
        create = create and stored_pages is None
        flags = os.O_RDONLY if stored_pages is not None else os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        # a writer owns the file, locked before the truncating open; readers share it
        self._lock = FileLock.acquire(path, "cold-pool file") if stored_pages is None else None
        try:
            self._fd, self.direct = open_direct(path, flags)
        except OSError as error:
            self._release()
            raise StorageError(f"{path}: cannot open the cold-pool file: {error.strerror}") from error
        if create:
            self._reserve()
        # a stored file is read in the pages its crcs cover (ColdImage.open checks this filesystem takes them)
        self.page = stored_pages.page if stored_pages is not None else direct_read_unit(self._fd, self.direct)
        self.pages = stored_pages if stored_pages is not None else \
            page_checksums(layout.file_bytes // self.page, self.page) if page_checksums is not None else None

    def _reserve(self) -> None:
        """Reserve the whole file now, so a full disk fails at creation rather than mid-generation."""
        try:
            os.posix_fallocate(self._fd, 0, max(self.layout.file_bytes, PAGE))
        except OSError as error:
            self.remove()
            raise StorageError(f"{self.path}: cannot reserve {format_size(self.layout.file_bytes)} for the cold pool "
                               f"({error.strerror}); free disk space or lower the context/batch") from error

    # ----- reading -----

    def read_many(self, layer: int, requests: Sequence[tuple[int, np.ndarray]]) -> list[tuple[np.ndarray, int]]:
        """Records at `slots` of each (seq, slots) of one layer (uint8 [len(slots), record_bytes], in the order given)
        and the bytes read, with every run of every request in flight at once.

        One parallel read instead of one per sequence: a batch's fetch waits for the disk once per layer.
        """
        return self.submit_many(layer, requests).result()

    def submit_many(self, layer: int, requests: Sequence[tuple[int, np.ndarray]]) -> PendingRecords:
        """`read_many` queued now (kernel AIO where available); `result()` waits, verifies and cuts out records."""
        plans = [PagePlan(np.asarray(slots, dtype=np.int64), self.layout.record_bytes, self.page)
                 for _, slots in requests]
        firsts = np.cumsum([0] + [len(plan.pages) for plan in plans])  # each plan's first page in the buffer
        buffer = self._take_read_buffer(int(firsts[-1]) * self.page)
        runs = [plan.runs(self.layout.region_offset(layer, seq), int(first))
                for (seq, _), plan, first in zip(requests, plans, firsts)]
        offsets, lengths, starts = (np.concatenate(part).astype(np.int64) for part in zip(*runs)) if runs \
            else (np.empty(0, dtype=np.int64),) * 3
        read = self.io.submit_scattered(self._fd, offsets, lengths, buffer, starts)
        return PendingRecords(self, layer, [seq for seq, _ in requests], plans, firsts, buffer, read)

    def _take_read_buffer(self, nbytes: int) -> np.ndarray:
        """The reusable read buffer (grown to `nbytes`), or a fresh one while another fetch still holds it."""
        if self._reading:
            return aligned_buffer(nbytes)
        if self._read_buffer.nbytes < nbytes:
            self._read_buffer = aligned_buffer(max(nbytes, 2 * self._read_buffer.nbytes))
        self._reading = True
        return self._read_buffer

    def _release_read_buffer(self, buffer: np.ndarray) -> None:
        if buffer is self._read_buffer:
            self._reading = False

    def _verify(self, layer: int, seq: int, page_numbers: np.ndarray, data: np.ndarray) -> None:
        """Check pages `page_numbers` of (layer, seq)'s region, read into `data`, against their crcs."""
        if self.pages is None or not len(page_numbers):
            return
        first = self.layout.region_offset(layer, seq) // self.page
        self._raise_on(layer, seq, self.pages.mismatch_at(first + page_numbers, data))

    def _raise_on(self, layer: int, seq: int, problem: str | None) -> None:
        if problem is not None:
            raise ChecksumError(f"{self.path}: cold records of layer {layer} sequence {seq}: {problem}; "
                                "the file is damaged: rerun the generation")

    # ----- writing -----

    def write_records(self, layer: int, seq: int, slots: Sequence[int] | np.ndarray, records: np.ndarray) -> None:
        """Write records (uint8 [n, record_bytes]) at `slots` of (layer, seq); other records are preserved."""
        slots = np.asarray(slots, dtype=np.int64)
        if not slots.size:
            return
        order = np.argsort(slots, kind="stable")
        slots, records = slots[order], np.asarray(records, dtype=np.uint8)[order]
        if slots[-1] >= self.layout.slots or slots[0] < 0:
            raise IndexError(f"{self.path}: slot out of range 0..{self.layout.slots - 1}")
        for span in consecutive_spans(slots.tolist()):
            first, last = int(slots[span.start]), int(slots[span.stop - 1])
            self._write_run(layer, seq, first, last, records[span])

    def _write_run(self, layer: int, seq: int, first: int, last: int, records: np.ndarray) -> None:
        rec, base = self.layout.record_bytes, self.layout.region_offset(layer, seq)
        start, end = first * rec, (last + 1) * rec
        page_start, page_end = start // PAGE * PAGE, round_up(end, PAGE)
        buffer = aligned_buffer(page_end - page_start)
        edges = {page_start} if start != page_start else set()
        if end != page_end:
            edges.add(page_end - PAGE)
        edges = sorted(edges)
        self.io.read_runs(self._fd, [(base + page, [memoryview(buffer[page - page_start : page - page_start + PAGE])])
                                     for page in edges])
        for page in edges:  # the neighbours' bytes kept in these pages must be what was written
            if self.pages is not None:
                self._raise_on(layer, seq, self.pages.mismatch(
                    base + page, buffer[page - page_start : page - page_start + PAGE], unwritten_ok=True))
        buffer[start - page_start : end - page_start] = records.reshape(-1)
        self.io.write_runs(self._fd, [(base + page_start, [memoryview(buffer)])])
        if self.pages is not None:
            self.pages.record_data(base + page_start, buffer)

    # ----- housekeeping -----

    def drop_page_cache(self) -> None:
        """Evict cached pages (matters only for the buffered fallback; O_DIRECT bypasses the cache)."""
        drop_page_cache(self._fd)

    def close(self) -> None:
        self._close(remove=False)

    def remove(self) -> None:
        """Close and delete the file; its lock goes last, so no other writer sees it half gone."""
        self._close(remove=True)

    def _close(self, remove: bool) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if remove and os.path.exists(self.path):
            os.unlink(self.path)
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()


class PendingRecords:
    """Records of `RecordFile.submit_many` while their pages are read."""

    def __init__(self, file: RecordFile, layer: int, seqs: list[int], plans: list[PagePlan], firsts: np.ndarray,
                 buffer: np.ndarray, read) -> None:
        self.file, self.layer, self.seqs, self.plans, self.firsts = file, layer, seqs, plans, firsts
        self.buffer, self.read = buffer, read

    def result(self) -> list[tuple[np.ndarray, int]]:
        """Per request, the records (uint8 [n, record_bytes], in the order asked) and the bytes read."""
        try:
            self.read.wait()
            out = []
            for seq, plan, first in zip(self.seqs, self.plans, self.firsts.tolist()):
                pages = self.buffer[first * plan.page : (first + len(plan.pages)) * plan.page]
                self.file._verify(self.layer, seq, plan.pages, pages)
                out.append((plan.gather(self.buffer, first), pages.nbytes))  # copies: the buffer is reused
            return out
        finally:
            self.file._release_read_buffer(self.buffer)


class PagePlan:
    """The `page`-byte pages holding some records of one region, and where each record lands once they are read."""

    def __init__(self, slots: np.ndarray, record_bytes: int, page: int) -> None:
        self.slots, self.record_bytes, self.page = slots, record_bytes, page
        self.first_page = slots * record_bytes // page
        self.run_pages, self.run_counts = page_runs(slots, record_bytes, page=page)
        self.pages = ranges(self.run_pages, self.run_counts)

    def runs(self, base: int, first: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(file offsets, byte lengths, buffer offsets) of the runs of adjacent pages, read from page `first` on."""
        into = first + np.cumsum(self.run_counts) - self.run_counts
        return base + self.run_pages * self.page, self.run_counts * self.page, into * self.page

    def gather(self, buffer: np.ndarray, first: int) -> np.ndarray:
        """uint8 [len(slots), record_bytes]: the records, cut out of the pages read into `buffer` from page `first`."""
        rec = self.record_bytes
        if not self.slots.size:
            return np.empty((0, rec), dtype=np.uint8)
        page_index = first + np.searchsorted(self.pages, self.first_page)
        starts = page_index * self.page + (self.slots * rec - self.first_page * self.page)
        # Rows of a view holding a record at every byte offset: one record-sized copy each (a per-byte index array
        # cost 20x more).
        return np.ndarray((buffer.nbytes - rec + 1, rec), np.uint8, buffer, 0, (1, 1))[starts]


def stored_pages(config: dict) -> PageChecksums:
    """The persisted page crcs of a stored file (ColdImage.scorer_config: its layout, crc file and page size), for
    the scorer process, which checks that file's pages against them."""
    with open(config["pages_path"], "rb") as file:
        return PageChecksums.from_bytes(file.read(), RecordLayout(**config["layout"]).file_bytes, config["page"])


def open_for_reading(path: str) -> tuple[int, bool]:
    """A read-only descriptor (O_DIRECT where possible) for a process that only scores the file."""
    try:
        return open_direct(path, os.O_RDONLY)
    except OSError as error:
        raise StorageError(f"{path}: cannot open the cold-pool file for scoring: {error.strerror}") from error
