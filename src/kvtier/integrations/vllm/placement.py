"""Where written bytes landed on the device (FIEMAP), for the benchmark's physical sequential share.

A tier's own counters say which logical addresses it wrote; whether the device saw one sequential
stream depends on where the filesystem put them. `physical_sequential_share` maps each write
(file, offset, length), in the order they were submitted, to its physical address through the
FS_IOC_FIEMAP ioctl and counts the writes that start where the previous one ended on the device.
"""

from __future__ import annotations

import fcntl
import struct
from collections.abc import Sequence
from pathlib import Path

FS_IOC_FIEMAP = 0xC020660B
FIEMAP_FLAG_SYNC = 1  # write dirty pages back first, so delayed allocations have their blocks
_HEADER = struct.Struct("=QQIIII")  # start, length, flags, mapped extents, extent count, reserved
_EXTENT = struct.Struct("=QQQQQIIII")  # logical, physical, length, reserved x2, flags, reserved x3
MAX_EXTENTS = 512

Extent = tuple[int, int, int]  # logical offset, physical offset, length


def file_extents(path: Path) -> list[Extent]:
    """The extents of `path` (sorted by logical offset); OSError where the filesystem has no FIEMAP."""
    extents: list[Extent] = []
    start = 0
    with open(path, "rb") as file:
        while True:
            request = bytearray(_HEADER.pack(start, 2**64 - 1 - start, FIEMAP_FLAG_SYNC, 0, MAX_EXTENTS, 0))
            request += bytes(_EXTENT.size * MAX_EXTENTS)
            fcntl.ioctl(file.fileno(), FS_IOC_FIEMAP, request)
            mapped = _HEADER.unpack_from(request)[3]
            for index in range(mapped):
                logical, physical, length, *_ = _EXTENT.unpack_from(request, _HEADER.size + index * _EXTENT.size)
                extents.append((logical, physical, length))
            if mapped < MAX_EXTENTS:
                return extents
            start = extents[-1][0] + extents[-1][2]


def physical_range(extents: list[Extent], offset: int, length: int) -> tuple[int, int] | None:
    """Physical (start, end) of bytes [offset, offset + length) when they lie in one extent, else None."""
    for logical, physical, extent_length in extents:
        if logical <= offset and offset + length <= logical + extent_length:
            return physical + offset - logical, physical + offset - logical + length
    return None


def physical_sequential_share(writes: Sequence[tuple[Path, int, int]]) -> float | None:
    """Share of `writes` after the first that start on the device where the previous one ended; None
    where FIEMAP is not available. A write split over extents counts as not sequential."""
    if len(writes) < 2:
        return None
    extents: dict[Path, list[Extent]] = {}
    try:
        for path in dict.fromkeys(path for path, _, _ in writes):
            extents[path] = file_extents(path)
    except OSError:
        return None
    ranges = [physical_range(extents[path], offset, length) for path, offset, length in writes]
    follows = sum(1 for before, after in zip(ranges, ranges[1:])
                  if before is not None and after is not None and after[0] == before[1])
    return follows / (len(writes) - 1)

