"""The tier's index on disk: an append-only journal of fixed-size records, each with its own crc32c.

A record says "chunk `key` (its bytes with crc32c `data_crc`) lies in slot `slot`" (PUT), "slots
[slot, slot + count) no longer hold what earlier records said" (RECLAIM: the log is about to
overwrite them), or "the log head stands at `slot`" (HEAD, how a compacted journal ends). Records
carry the allocation sequence number: on replay the head follows the PUT or HEAD allocated last.

A process killed mid-append, or a machine that lost power, leaves a torn or half-written tail:
replay stops at the first record whose crc does not match (or that is cut short), keeps everything
before it and truncates the rest, so new records follow the last good one. The journal is never
the only guard: every chunk read back is checked against its crc before anyone sees it.

One process writes a journal: opening it takes its lock (kvtier.storage.file_lock) before the
replay may cut anything off, so a second opener gets an error naming the first one's pid.

Compaction rewrites only the live entries to a temporary file, fsyncs it and renames it over the
journal (and fsyncs the directory), so a crash during compaction leaves the old or the new one.

Layout (little endian): a 96-byte header record (magic "KVTIERIX", format version, the flash
file's 16-byte id, crc) followed by 96-byte records:
    crc u32 | kind u32 | seq u64 | slot u32 | count u32 | data_crc u32 | key length u16 | 0 u16 | key 64 bytes
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np

from kvtier.errors import ConfigError, StorageError
from kvtier.storage import fsync_directory
from kvtier.storage.file_lock import FileLock

log = logging.getLogger(__name__)

MAGIC = b"KVTIERIX"
VERSION = 1
PUT, RECLAIM, HEAD = 1, 2, 3
MAX_KEY = 64
_HEADER = struct.Struct(f"<8sI16s{96 - 8 - 4 - 16 - 4}x")
_RECORD = struct.Struct(f"<IQIIIHH{MAX_KEY}s")  # everything after the crc
RECORD_BYTES = 4 + _RECORD.size
RECORD_DTYPE = np.dtype([("crc", "<u4"), ("kind", "<u4"), ("seq", "<u8"), ("slot", "<u4"), ("count", "<u4"),
                         ("data_crc", "<u4"), ("key_length", "<u2"), ("zero", "<u2"), ("key", "V64")])
KEY_OFFSET = RECORD_DTYPE.fields["key"][1]
assert _HEADER.size + 4 == RECORD_BYTES == RECORD_DTYPE.itemsize == 96


@dataclass(frozen=True)
class Record:
    kind: int
    seq: int
    slot: int
    count: int = 1
    data_crc: int = 0
    key: bytes = b""

    def encode(self) -> bytes:
        if len(self.key) > MAX_KEY:
            raise ConfigError(f"offload key of {len(self.key)} bytes is longer than the {MAX_KEY} bytes "
                              "a journal record holds")
        body = _RECORD.pack(self.kind, self.seq, self.slot, self.count, self.data_crc, len(self.key), 0,
                            self.key)
        return _crc(body).to_bytes(4, "little") + body


def put(seq: int, slot: int, data_crc: int, key: bytes) -> Record:
    return Record(PUT, seq, slot, 1, data_crc, key)


def reclaim(seq: int, first_slot: int, count: int) -> Record:
    return Record(RECLAIM, seq, first_slot, count)


def head(seq: int, slot: int) -> Record:
    return Record(HEAD, seq, slot, 0)


class Journal:
    """The journal file of one flash file: replay on open, then appends (optionally fdatasync'ed)."""

    def __init__(self, path: Path, file_id: bytes, fsync: bool = False) -> None:
        self.path, self.file_id, self.fsync = path, file_id, fsync
        self.records = _parse(b"")  # what the journal held when opened (replayed, then released)
        self.dropped_bytes = 0  # torn or corrupt tail cut off at open
        self.count = 0  # records in the file now
        self._end = RECORD_BYTES  # where the next record goes
        self._lock = FileLock.acquire(path, "index journal")  # a sidecar: compaction renames a new journal over this
        try:
            self._fd = self._open()
        except BaseException:
            self._lock.release()
            raise

    def _open(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise StorageError(f"cannot open the tier's index journal {self.path}: {error.strerror}") from None
        try:
            data = _read_all(fd)
            if not self._header_matches(data):
                if data:
                    log.warning("%s belongs to another flash file or is unreadable; starting an empty index", self.path)
                os.ftruncate(fd, 0)
                os.pwrite(fd, self._header(), 0)
                return fd
            self.records = _parse(data[RECORD_BYTES:])
            end = RECORD_BYTES * (1 + len(self.records))
            if end < len(data):
                self.dropped_bytes = len(data) - end
                log.warning("%s: dropped a torn or corrupt tail of %d bytes after %d good records",
                            self.path, self.dropped_bytes, len(self.records))
                os.ftruncate(fd, end)
            self.count, self._end = len(self.records), end
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _header(self) -> bytes:
        body = _HEADER.pack(MAGIC, VERSION, self.file_id)
        return body + _crc(body).to_bytes(4, "little")

    def _header_matches(self, data: bytes) -> bool:
        header = data[:RECORD_BYTES]
        return len(header) == RECORD_BYTES and header == self._header()

    def append(self, records: list[Record]) -> None:
        """Add `records` at the end with one write (and one fdatasync when asked to)."""
        if not records:
            return
        payload = b"".join(record.encode() for record in records)
        _write_all(self._fd, payload, self._end, self.path)
        if self.fsync:
            os.fdatasync(self._fd)
        self.count += len(records)
        self._end += len(payload)

    def rewrite(self, records: list[Record]) -> None:
        """Replace the journal by `records`, crash-safely: temp file, fsync, rename, fsync the directory."""
        partial = self.path.with_name(f".{self.path.name}.partial-{os.getpid()}")
        fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, self._header() + b"".join(record.encode() for record in records), 0, partial)
            os.fsync(fd)
            os.replace(partial, self.path)
        except BaseException:
            os.close(fd)
            partial.unlink(missing_ok=True)
            raise
        fsync_directory(self.path.parent)
        os.close(self._fd)
        self._fd, self.count, self._end = fd, len(records), RECORD_BYTES * (1 + len(records))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._lock.release()


@dataclass
class Records:
    """Records as read back: the fixed fields as one numpy array (RECORD_DTYPE) and the keys."""

    array: np.ndarray
    keys: list[bytes]

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[Record]:
        for fields, key in zip(self.array.tolist(), self.keys):
            yield Record(fields[1], fields[2], fields[3], fields[4], fields[5], key)


def _parse(data: bytes) -> Records:
    """The records at the start of `data` up to the first torn or corrupt one (vectorized but the crcs)."""
    count = len(data) // RECORD_BYTES
    array = np.frombuffer(data, dtype=RECORD_DTYPE, count=count)
    view = memoryview(data)
    found = np.fromiter((crc32c.crc32c(view[start + 4 : start + RECORD_BYTES])
                         for start in range(0, count * RECORD_BYTES, RECORD_BYTES)), dtype=np.uint32, count=count)
    bad = (found != array["crc"]) | ~np.isin(array["kind"], (PUT, RECLAIM, HEAD)) | (array["key_length"] > MAX_KEY)
    good = int(np.argmax(bad)) if bad.any() else count
    lengths = array["key_length"][:good].tolist()
    keys = [data[start + KEY_OFFSET : start + KEY_OFFSET + length]
            for start, length in zip(range(0, good * RECORD_BYTES, RECORD_BYTES), lengths)]
    return Records(array[:good], keys)


def _crc(data: bytes | memoryview) -> int:
    return crc32c.crc32c(data) & 0xFFFFFFFF


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0) if size else b""


def _write_all(fd: int, payload: bytes, offset: int, path: Path) -> None:
    view = memoryview(payload)
    while view:
        try:
            moved = os.pwrite(fd, view, offset)
        except OSError as error:
            raise StorageError(f"cannot write the tier's index journal {path}: {error.strerror}") from None
        view, offset = view[moved:], offset + moved

