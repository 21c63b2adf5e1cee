"""A sparse cache set aside while the serving engine runs others: its windows and hot pools to a file, and back.

The engine preempts a tiered sequence to hand its device window and host share to another. Only what is not
on flash already leaves memory: per tiered layer, the device window's K/V and the hot pool's K/V (the keys
in their tiles). The cold pool, its sketches, the scorer process with whatever it has in flight, the hit
tables and the positions (a few bytes a token) stay where they are, so the sequence resumes exactly where it
stopped. The file sits beside the cold pool's (`<cold stem>.aside`, locked by this process), written in one
sequential pass with O_DIRECT where the filesystem takes it, one page-aligned region per layer, with the
crc32c of every page kept in memory. Bringing it back reads every region and checks every page before a byte
is used (ChecksumError on a mismatch, the cache unchanged), then deletes the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvtier.errors import ChecksumError, StorageError
from kvtier.storage import PAGE, IOEngine, aligned_buffer, open_direct, round_up
from kvtier.storage.checksum import unit_checksums
from kvtier.storage.file_lock import FileLock

SUFFIX = ".aside"


class Tiered(Protocol):
    """A tiered layer that can let go of its in-memory K/V (SparseLayer)."""

    def set_aside(self) -> list[torch.Tensor]: ...

    def bring_back(self, held: list[torch.Tensor]) -> None: ...


@dataclass(frozen=True)
class _Region:
    """One layer's tensors, back to back from `offset`, and the crc32c of each of the region's pages."""

    offset: int
    specs: tuple[tuple[tuple[int, ...], torch.dtype], ...]  # (shape, dtype) of each tensor, in order
    crcs: np.ndarray

    @property
    def nbytes(self) -> int:
        return len(self.crcs) * PAGE


@dataclass
class SetAside:
    """Where a cache's windows and hot pools wait: its file, one region per layer."""

    path: str
    regions: list[_Region]
    lock: FileLock

    @property
    def nbytes(self) -> int:
        """Bytes written (whole pages)."""
        return sum(region.nbytes for region in self.regions)


def set_aside(layers: list[Tiered], stem: str, io: IOEngine) -> SetAside:
    """Write every layer's window and hot pool to `<stem>.aside` and let go of them.

    Raises StorageError (a full disk, an unwritable directory) with every layer as it was and no file left.
    """
    path = stem + SUFFIX
    lock = FileLock.acquire(path, "set-aside K/V file")
    held: list[list[torch.Tensor]] = []  # views: the memory goes when `held` does
    try:
        for layer in layers:
            held.append(layer.set_aside())
        regions = _write(path, held, io)
    except BaseException as error:
        for layer, tensors in zip(layers, held):
            layer.bring_back(tensors)
        _remove(path, lock)
        if isinstance(error, OSError):
            raise StorageError(f"{path}: cannot set the sequence's KV aside: {error.strerror}") from None
        raise
    return SetAside(path, regions, lock)


def bring_back(layers: list[Tiered], aside: SetAside, io: IOEngine) -> None:
    """Read the file back, check every page, restore every layer, delete the file.

    Raises ChecksumError or StorageError with no layer restored (the file is kept for `discard`).
    """
    fd, _ = _open(aside.path, os.O_RDONLY)
    try:
        buffers = [_read(fd, region, io, aside.path) for region in aside.regions]
    finally:
        os.close(fd)
    for layer, region, data in zip(layers, aside.regions, buffers):
        layer.bring_back(_unpacked(data, region.specs))
    discard(aside)


def discard(aside: SetAside) -> None:
    """Delete the file and its lock (the sequence ended while set aside, or its KV could not be read)."""
    _remove(aside.path, aside.lock)


def _write(path: str, held: list[list[torch.Tensor]], io: IOEngine) -> list[_Region]:
    fd, _ = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        regions, offset = [], 0
        for tensors in held:
            data = _packed(tensors)
            io.write_runs(fd, [(offset, [memoryview(data)])])
            regions.append(_Region(offset, tuple((tuple(t.shape), t.dtype) for t in tensors),
                                   unit_checksums(data, PAGE)))
            offset += len(data)
        return regions
    finally:
        os.close(fd)


def _read(fd: int, region: _Region, io: IOEngine, path: str) -> np.ndarray:
    data = aligned_buffer(region.nbytes)
    io.read_runs(fd, [(region.offset, [memoryview(data)])])
    bad = np.flatnonzero(unit_checksums(data, PAGE) != region.crcs)
    if len(bad):
        raise ChecksumError(f"{path}: {len(bad)} page(s) of a set-aside sequence's KV failed their checksum "
                            f"(first at byte {region.offset + int(bad[0]) * PAGE})")
    return data


def _packed(tensors: list[torch.Tensor]) -> np.ndarray:
    """The tensors' bytes back to back in a page-aligned buffer of whole pages."""
    flat = [_bytes(t) for t in tensors]
    data = aligned_buffer(round_up(max(sum(len(f) for f in flat), 1), PAGE))
    offset = 0
    for part in flat:
        data[offset: offset + len(part)] = part
        offset += len(part)
    return data


def _unpacked(data: np.ndarray, specs: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> list[torch.Tensor]:
    tensors, offset = [], 0
    for shape, dtype in specs:
        tensor = torch.empty(shape, dtype=dtype)
        target = _bytes(tensor)
        target[:] = data[offset: offset + len(target)]
        tensors.append(tensor)
        offset += len(target)
    return tensors


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous host tensor's bytes as a flat uint8 array (a view)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


def _open(path: str, flags: int) -> tuple[int, bool]:
    try:
        return open_direct(path, flags)
    except OSError as error:
        raise StorageError(f"{path}: cannot open a set-aside sequence's KV file: {error.strerror}") from None


def _remove(path: str, lock: FileLock) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    lock.release()
