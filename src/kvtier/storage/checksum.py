"""CRC32C checksums of KV blocks, and the table that stores one per block on disk.

crc32c (SSE4.2 / ARMv8 instructions, GIL released on large buffers) runs at
many GB/s, far above the disk, so every block is verified on every read.
The table holds one (crc, written) entry per (layer, kind, block); a block
whose entry is not marked written has never been stored and cannot be read.
"""

from __future__ import annotations

from typing import Any

import crc32c
import numpy as np

from kvtier.kernels import ops
from kvtier.storage.aligned import aligned_buffer, byte_view
from kvtier.storage.geometry import PAGE, round_up

ENTRY = np.dtype([("crc", "<u4"), ("written", "<u4")])
WRITTEN = 1


def checksum(buf: Any) -> int:
    """CRC32C of the bytes of `buf` (any contiguous buffer), as an unsigned 32-bit int."""
    return crc32c.crc32c(byte_view(buf)) & 0xFFFFFFFF


def unit_checksums(data: np.ndarray, unit: int) -> np.ndarray:
    """The CRC32C of each `unit`-byte piece of `data` (contiguous bytes, whole units), uint32, in one call."""
    return ops.crc32c_units(data, unit=unit)


class ChecksumTable:
    """Page-aligned in-memory image of the on-disk checksum table, indexed by block slot."""

    def __init__(self, num_slots: int) -> None:
        self.nbytes = self.nbytes_for(num_slots)
        self.buffer = aligned_buffer(self.nbytes)
        self._entries = self.buffer[: num_slots * ENTRY.itemsize].view(ENTRY)

    @staticmethod
    def nbytes_for(num_slots: int) -> int:
        """On-disk size of the table: whole pages, so it can be read and written with O_DIRECT."""
        return round_up(num_slots * ENTRY.itemsize, PAGE)

    def stored_crc(self, slot: int) -> int | None:
        """The checksum written with the block in `slot`, or None if that block was never written."""
        entry = self._entries[slot]
        return int(entry["crc"]) if entry["written"] == WRITTEN else None

    def record(self, slot: int, crc: int) -> int:
        """Mark the block in `slot` written with checksum `crc`; return the table page that changed."""
        self._entries[slot] = (crc, WRITTEN)
        return slot * ENTRY.itemsize // PAGE

    def pages(self, first_page: int, num_pages: int) -> memoryview:
        """The bytes of table pages [first_page, first_page + num_pages), page-aligned for O_DIRECT."""
        return memoryview(self.buffer[first_page * PAGE:(first_page + num_pages) * PAGE])


class PageChecksums:
    """In-memory CRC32C of every page of a file's data region, for reads of single pages.

    A page is a file's read unit (`direct_read_unit`: 512 bytes where O_DIRECT takes sectors, else 4 KiB), so a
    read of a few records costs the sectors holding them, not their 4 KiB pages. A block's stored crc covers the
    whole block, so a read of a few of its pages cannot be checked against it. These are recorded as blocks are
    written through one open file object; a file that outlives its writer (a stored sparse image) keeps them
    beside it (`to_bytes` / `from_bytes`).
    """

    def __init__(self, num_pages: int, page: int = PAGE) -> None:
        self.page = page
        self._crcs = np.zeros(num_pages, dtype=np.uint32)
        self._written = np.zeros(num_pages, dtype=bool)

    @classmethod
    def over(cls, crcs: np.ndarray, written: np.ndarray, page: int) -> PageChecksums:
        """A table kept in arrays someone else owns (uint32 crcs, bool written; shared memory, so that another
        process checks what this one writes). They must start zeroed."""
        table = cls(0, page)
        table._crcs, table._written = crcs, written
        return table

    def of(self, data: np.ndarray) -> np.ndarray:
        """The crc of each page of `data` (flat bytes, a whole number of pages), uint32, in one call."""
        return unit_checksums(data, self.page)

    def record(self, first_page: int, crcs: np.ndarray) -> None:
        """Pages first_page.. now hold data with these crcs (call once the data is on disk)."""
        self._crcs[first_page : first_page + len(crcs)] = crcs
        self._written[first_page : first_page + len(crcs)] = True

    def record_data(self, offset: int, data: np.ndarray) -> None:
        """`data` (whole pages) is now on disk at byte `offset` of the data region."""
        self.record(offset // self.page, self.of(data))

    def mismatch(self, offset: int, data: np.ndarray, unwritten_ok: bool = False) -> str | None:
        """Why the pages at byte `offset` of the data region do not hold `data` (None when every page checks out)."""
        first = offset // self.page
        return self.mismatch_at(np.arange(first, first + data.size // self.page), data, unwritten_ok)

    def mismatch_at(self, numbers: np.ndarray, data: np.ndarray, unwritten_ok: bool = False) -> str | None:
        """Why pages `numbers` do not hold `data` (their bytes back to back); None when every page checks out.

        With `unwritten_ok`, a page never written is accepted as it is (a read-modify-write's fresh edge page).
        """
        written, found = self._written[numbers], self.of(data)
        bad = written & (found != self._crcs[numbers])
        if not unwritten_ok:
            bad |= ~written
        if not bad.any():
            return None
        first = int(np.argmax(bad))
        number = int(numbers[first])
        where = f"data page {number} ({self.page} bytes at {number * self.page})"
        if not written[first]:
            return f"{where} was never written"
        stored = int(self._crcs[number])
        return f"checksum mismatch in {where} (stored 0x{stored:08x}, read 0x{int(found[first]):08x})"

    def copy(self, first_page: int, source: PageChecksums, source_first: int, count: int) -> None:
        """Pages first_page.. take the entries of `source`'s pages source_first.. (their bytes were copied there)."""
        taken = slice(source_first, source_first + count)
        self._crcs[first_page : first_page + count] = source._crcs[taken]
        self._written[first_page : first_page + count] = source._written[taken]

    def to_bytes(self) -> bytes:
        """The table for a file that outlives its writer: crcs, written flags, then a crc32c of both."""
        body = self._crcs.tobytes() + self._written.tobytes()
        return body + np.uint32(checksum(body)).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, data_bytes: int, page: int) -> PageChecksums:
        """The table `to_bytes` wrote for `data_bytes` of `page`-byte pages; ValueError when it is cut short or fails
        its crc."""
        num_pages = data_bytes // page
        body_bytes = num_pages * 5
        if len(data) != body_bytes + 4 or checksum(data[:body_bytes]) != int(np.frombuffer(data[body_bytes:], "<u4")[0]):
            raise ValueError("page checksum table damaged")
        table = cls(num_pages, page)
        table._crcs[:] = np.frombuffer(data, "<u4", num_pages)
        table._written[:] = np.frombuffer(data, np.bool_, num_pages, offset=num_pages * 4)
        return table
