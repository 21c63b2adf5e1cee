"""Opening files for direct (page-cache bypassing) I/O, with a fallback where the FS refuses it.

O_DIRECT makes reads hit the disk, so cold-tier timings are honest and the
page cache does not double the memory footprint. Some filesystems (ramfs,
some FUSE and network filesystems) reject it with EINVAL; there we fall back
to buffered I/O and tell the user once, and benchmarks call
`drop_page_cache` instead.
"""

from __future__ import annotations

import errno
import logging
import os

from kvtier.storage.aligned import aligned_buffer
from kvtier.storage.geometry import PAGE, SECTOR

log = logging.getLogger(__name__)


def open_direct(path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> tuple[int, bool]:
    """Open `path` with `flags | O_DIRECT` if the filesystem allows it; return (fd, direct)."""
    try:
        return os.open(path, flags | os.O_DIRECT, mode), True
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
    log.warning("%s: the filesystem does not support O_DIRECT; using buffered I/O "
                "(reads may come from the page cache)", os.fspath(path))
    # The refused open may already have created the file: with O_EXCL it did not exist before
    # (else EEXIST, not EINVAL), so it is ours and the retry must not fail on it.
    return os.open(path, flags & ~os.O_EXCL, mode), False


def direct_read_unit(fd: int, direct: bool) -> int:
    """The smallest read size and alignment `fd` accepts: SECTOR where an O_DIRECT read of one sector off a page
    boundary succeeds (or without O_DIRECT), else PAGE. The file must hold at least one page."""
    if not direct:
        return SECTOR
    try:
        os.preadv(fd, [memoryview(aligned_buffer(SECTOR))], SECTOR)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        return PAGE
    return SECTOR


def drop_page_cache(fd: int) -> None:
    """Ask the kernel to evict the file's clean cached pages, so the next reads come from the disk.

    No fsync first: pages still dirty stay cached until written back, so callers that need
    cold reads of freshly written data should write through O_DIRECT or sync themselves.
    """
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def write_new_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Create `path` (it must not exist) holding `data`, fsynced: one step of write, fsync, rename."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make a rename or a new file in `directory` durable (write, fsync, rename, then this)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
