import errno
import fcntl
import logging
import os

import pytest

from kvtier.storage import direct_file
from kvtier.storage.aligned import aligned_buffer
from kvtier.storage.direct_file import direct_read_unit, drop_page_cache, open_direct, write_new_file
from kvtier.storage.geometry import PAGE, SECTOR


def _write_and_read_back(fd):
    page = aligned_buffer(PAGE)
    page[:] = 42
    assert os.pwrite(fd, page, 0) == PAGE
    back = aligned_buffer(PAGE)
    assert os.preadv(fd, [back], 0) == PAGE
    assert (back == 42).all()


def test_real_disk_opens_direct(direct_dir, caplog):
    fd, direct = open_direct(direct_dir / "f", os.O_RDWR | os.O_CREAT)
    try:
        assert direct
        assert fcntl_flags(fd) & os.O_DIRECT
        _write_and_read_back(fd)
    finally:
        os.close(fd)
    assert not caplog.records


def fcntl_flags(fd):
    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_filesystem_without_o_direct_falls_back_with_one_warning(no_direct_dir, caplog):
    path = no_direct_dir / "f"
    with caplog.at_level(logging.WARNING, logger=direct_file.__name__):
        fd, direct = open_direct(path, os.O_RDWR | os.O_CREAT)
    try:
        assert not direct
        assert not fcntl_flags(fd) & os.O_DIRECT
        _write_and_read_back(fd)
    finally:
        os.close(fd)
    assert [record.levelno for record in caplog.records] == [logging.WARNING]
    assert str(path) in caplog.records[0].getMessage()


def test_fallback_creates_exclusively_on_filesystem_without_o_direct(no_direct_dir):
    fd, direct = open_direct(no_direct_dir / "new", os.O_RDWR | os.O_CREAT | os.O_EXCL)
    os.close(fd)
    assert not direct
    with pytest.raises(FileExistsError):
        open_direct(no_direct_dir / "new", os.O_RDWR | os.O_CREAT | os.O_EXCL)


def test_fallback_when_open_reports_einval(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def open_without_direct(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", open_without_direct)
    fd, direct = open_direct(tmp_path / "g", os.O_RDWR | os.O_CREAT)
    os.close(fd)
    assert direct is False
    assert len(caplog.records) == 1 and "does not support O_DIRECT" in caplog.records[0].getMessage()


def _logical_block_size(path) -> int | None:
    """What sysfs says of the logical block of the device holding `path` (None where it has no such entry)."""
    device = os.stat(path).st_dev
    entry = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"
    for queue in (f"{entry}/queue", f"{entry}/../queue"):  # a whole disk, or a partition's disk
        try:
            with open(f"{queue}/logical_block_size") as file:
                return int(file.read())
        except OSError:
            continue
    return None


def _reserved(path, flags=os.O_RDWR | os.O_CREAT):
    fd, direct = open_direct(path, flags)
    os.posix_fallocate(fd, 0, PAGE)
    return fd, direct


def test_read_unit_is_the_devices_logical_block(direct_dir):
    block = _logical_block_size(direct_dir)
    if block is None:
        pytest.skip(f"sysfs does not describe the device holding {direct_dir}")
    fd, direct = _reserved(direct_dir / "unit")
    try:
        assert direct and direct_read_unit(fd, direct) == (SECTOR if block <= SECTOR else PAGE)
    finally:
        os.close(fd)


def test_read_unit_is_a_page_where_o_direct_refuses_sectors(direct_dir, monkeypatch):
    fd, direct = _reserved(direct_dir / "unit")

    def refuse(*args):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "preadv", refuse)
    try:
        assert direct_read_unit(fd, direct) == PAGE
    finally:
        os.close(fd)


def test_read_unit_without_o_direct_is_a_sector_and_other_errors_propagate(tmp_path):
    fd, _ = _reserved(tmp_path / "unit")
    try:
        assert direct_read_unit(fd, False) == SECTOR
    finally:
        os.close(fd)
    with pytest.raises(OSError) as raised:
        direct_read_unit(fd, True)  # closed
    assert raised.value.errno == errno.EBADF


def test_other_open_errors_propagate(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_direct(tmp_path / "missing" / "f", os.O_RDWR)


def test_drop_page_cache_evicts_the_file(tmp_path, cached_pages):
    path = tmp_path / "h"
    path.write_bytes(os.urandom(8 * PAGE))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages only: dirty ones are not dropped
        os.pread(fd, 8 * PAGE, 0)
        assert cached_pages(path) == 8
        drop_page_cache(fd)
        assert cached_pages(path) == 0
    finally:
        os.close(fd)


def test_write_new_file_creates_and_never_overwrites(tmp_path):
    path = tmp_path / "meta.json"
    write_new_file(path, b"first")
    assert path.read_bytes() == b"first"
    with pytest.raises(FileExistsError):
        write_new_file(path, b"second")
    assert path.read_bytes() == b"first"
