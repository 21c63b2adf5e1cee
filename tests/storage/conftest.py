"""Fixtures for storage tests: real filesystems with the properties under test.

Small filesystems are mounted for one test: tmpfs with a 1 MiB limit is a disk
that is full for any real KV file, a read-only tmpfs an unwritable directory,
and ramfs refuses O_DIRECT (EINVAL), so the buffered fallback runs on a real
FS. Mounting needs root; those tests are skipped with the reason otherwise.
(tmpfs itself accepts O_DIRECT since Linux 6.6, so it cannot play that part.)
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.storage.geometry import PAGE


def _mount(tmp_path: Path, fstype: str, options: str) -> Iterator[Path]:
    target = tmp_path / f"mnt-{fstype}"
    target.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", fstype, "-o", options, fstype, str(target)],
                                 capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command on this machine")
    if mounted.returncode != 0:
        pytest.skip(f"mounting {fstype} is not permitted here: {mounted.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a 1 MiB tmpfs."""
    yield from _mount(tmp_path, "tmpfs", "size=1m")


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a read-only tmpfs."""
    yield from _mount(tmp_path, "tmpfs", "ro,size=1m")


@pytest.fixture
def no_direct_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on ramfs, which rejects O_DIRECT."""
    yield from _mount(tmp_path, "ramfs", "mode=755")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    """tmp_path, where O_DIRECT must work (skipped on a filesystem without it)."""
    try:
        os.close(os.open(tmp_path / ".probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT))
    except OSError as error:
        pytest.skip(f"{tmp_path} does not support O_DIRECT: {error}")
    return tmp_path


def _cached_pages(path: Path) -> int:
    """How many pages of the file are in the page cache (mincore on a fresh mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    residency = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address != ctypes.c_void_p(-1).value, os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(address, size, residency) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(flag & 1 for flag in residency)


@pytest.fixture
def cached_pages() -> Callable[[Path], int]:
    """Counts the pages of a file that are in the page cache."""
    return _cached_pages
