"""The tier's flash file: one header page, then fixed-size 4 KiB-aligned slots, one chunk each.

Page 0 (little endian): magic "KVTIERVF" | format version u32 | JSON length u32 | crc32c u32 | JSON.
The JSON records the chunk size, the slot count, a random file id (which binds the index journal
to this file) and the identity of the KV it holds (model, dtype, tokens per hash, layer groups,
parallel layout): a file written for another model or layout is refused with the differing field
named, never overwritten. The data region is preallocated when the file is created, so appends
find their blocks already placed and the file never grows.

The file is opened with O_DIRECT where the filesystem allows it (`direct` says which) and locked
(flock) so that two processes never share one log; the lock dies with its process, even on SIGKILL.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
import uuid
from pathlib import Path
from typing import Any

from kvtier.errors import ChecksumError, ConfigError, StorageError
from kvtier.storage import PAGE, aligned_buffer, checksum, open_direct, round_up

MAGIC = b"KVTIERVF"
VERSION = 1
_FIXED = struct.Struct("<8sII")
_CRC = struct.Struct("<I")


class FlashFile:
    """An open flash file: `fd`, `direct`, slot geometry and `offset(slot)`."""

    def __init__(self, path: Path, fd: int, direct: bool, header: dict[str, Any]) -> None:
        self.path, self.fd, self.direct = path, fd, direct
        self.chunk_bytes: int = header["chunk_bytes"]
        self.num_slots: int = header["num_slots"]
        self.slot_bytes = round_up(self.chunk_bytes, PAGE)
        self.file_id = bytes.fromhex(header["file_id"])
        self.created = False

    @classmethod
    def open_or_create(cls, path: Path, chunk_bytes: int, capacity_bytes: int, identity: dict[str, Any]) -> FlashFile:
        """The flash file at `path` for chunks of `chunk_bytes`; created with `capacity_bytes` of slots if absent."""
        if not path.parent.is_dir():
            raise StorageError(f"directory {path.parent} of the flash file does not exist; create it or pass another path")
        try:
            fd, direct = open_direct(path, os.O_RDWR | os.O_CREAT)
        except OSError as error:
            raise StorageError(f"cannot open flash file {path}: {error.strerror}") from None
        try:
            _lock(fd, path)
            if os.fstat(fd).st_size == 0:
                file = cls._create(path, fd, direct, chunk_bytes, capacity_bytes, identity)
            else:
                file = cls(path, fd, direct, _read_header(fd, path))
                file._check(chunk_bytes, identity, os.fstat(fd).st_size)
            return file
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def _create(cls, path: Path, fd: int, direct: bool, chunk_bytes: int, capacity_bytes: int,
                identity: dict[str, Any]) -> FlashFile:
        num_slots = capacity_bytes // round_up(chunk_bytes, PAGE)
        if num_slots < 1:
            os.unlink(path)
            raise ConfigError(f"flash tier capacity of {capacity_bytes} bytes holds no chunk of {chunk_bytes} bytes; "
                              "give a larger capacity")
        header = {"chunk_bytes": chunk_bytes, "num_slots": num_slots, "file_id": uuid.uuid4().hex,
                  "identity": identity, "format": VERSION}
        file = cls(path, fd, direct, header)
        try:
            os.posix_fallocate(fd, 0, file.offset(num_slots))
            page = aligned_buffer(PAGE)
            page[:] = memoryview(_encode(header))
            os.pwrite(fd, page, 0)
            os.fsync(fd)
        except OSError as error:
            os.unlink(path)
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageError(f"no space for a {file.offset(num_slots)}-byte flash file at {path}; "
                                   "free space or give a smaller capacity") from None
            raise StorageError(f"cannot create flash file {path}: {error.strerror}") from None
        file.created = True
        return file

    def _check(self, chunk_bytes: int, identity: dict[str, Any], size: int) -> None:
        stored = _read_header(self.fd, self.path)
        if stored["chunk_bytes"] != chunk_bytes:
            raise ConfigError(f"{self.path} holds chunks of {stored['chunk_bytes']} bytes, this vLLM offloads "
                              f"{chunk_bytes}-byte chunks; pass another path or delete the file")
        differing = sorted(name for name in set(identity) | set(stored["identity"])
                           if identity.get(name) != stored["identity"].get(name))
        if differing:
            name = differing[0]
            raise ConfigError(f"{self.path} holds KV of another configuration ({name}: "
                              f"{stored['identity'].get(name)!r} there, {identity.get(name)!r} here); "
                              "pass another path or delete the file")
        if size < self.offset(self.num_slots):
            raise StorageError(f"{self.path} is truncated ({size} of {self.offset(self.num_slots)} bytes); "
                               "delete the file")

    def offset(self, slot: int) -> int:
        return PAGE + slot * self.slot_bytes

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # also drops the lock
            self.fd = -1


def _lock(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise StorageError(f"flash file {path} is in use by another process; give each vLLM instance its own "
                           "path") from None


def _encode(header: dict[str, Any]) -> bytes:
    body = json.dumps(header, sort_keys=True).encode()
    if _FIXED.size + _CRC.size + len(body) > PAGE:
        raise ConfigError(f"flash file header of {len(body)} bytes does not fit its {PAGE}-byte page "
                          "(a very long model name?)")
    fixed = _FIXED.pack(MAGIC, VERSION, len(body))
    return (fixed + _CRC.pack(checksum(fixed + body)) + body).ljust(PAGE, b"\0")


def _read_header(fd: int, path: Path) -> dict[str, Any]:
    page = aligned_buffer(PAGE)
    read = os.preadv(fd, [page], 0)
    data = bytes(page[:read])
    if data[: len(MAGIC)] != MAGIC:
        raise StorageError(f"{path} is not a kvtier flash tier file (it starts with {data[:8]!r}); "
                           "choose another path")
    _, version, length = _FIXED.unpack_from(data)
    if version != VERSION:
        raise StorageError(f"{path} has flash tier format {version}, this kvtier reads {VERSION}; delete the file")
    start = _FIXED.size + _CRC.size
    body = data[start : start + length]
    if len(body) != length or checksum(data[: _FIXED.size] + body) != _CRC.unpack_from(data, _FIXED.size)[0]:
        raise ChecksumError(f"{path}: the flash file header is corrupt; delete the file")
    return json.loads(body)
