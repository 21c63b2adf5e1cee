import os
from contextlib import contextmanager

import numpy as np
import pytest

from kvtier.sparse import record_file
from kvtier.sparse.record_file import RecordFile, RecordLayout
from kvtier.storage import PAGE, SECTOR, IOEngine, direct_read_unit, open_direct, round_up
from kvtier.storage.checksum import PageChecksums
from kvtier.storage.file_lock import FileInUseError


@pytest.fixture(params=[SECTOR, PAGE], ids=["sectors", "pages"])
def page(request, monkeypatch, tmp_path):
    """Each test runs with both read units: 4 KiB pages forced (as where O_DIRECT refuses sectors), and sectors
    where this filesystem takes them."""
    if request.param == PAGE:
        monkeypatch.setattr(record_file, "direct_read_unit", lambda fd, direct: PAGE)
        return PAGE
    fd, direct = open_direct(tmp_path / "probe", os.O_RDWR | os.O_CREAT)
    try:
        os.posix_fallocate(fd, 0, PAGE)
        if direct_read_unit(fd, direct) != SECTOR:
            pytest.skip(f"{tmp_path}: O_DIRECT does not take 512-byte reads here")
    finally:
        os.close(fd)
        os.unlink(tmp_path / "probe")
    return SECTOR


def _read(file, layer, seq, slots):
    """Records at `slots` of one region and the bytes read."""
    return file.read_many(layer, [(seq, np.asarray(slots))])[0]


def _records(count, size, seed):
    return np.random.default_rng(seed).integers(0, 256, (count, size), dtype=np.uint8)


@contextmanager
def _open_pool(tmp_path, layout):
    """A fresh RecordFile on a 2-thread engine; removed afterwards."""
    with IOEngine(2) as io:
        file = RecordFile(str(tmp_path / "pool"), layout, io)
        try:
            yield file
        finally:
            file.remove()


def test_regions_start_on_pages():
    layout = RecordLayout(record_bytes=300, layers=2, batch=3, slots=100)
    assert layout.region_stride == 32768  # 30000 bytes rounded up to pages
    assert layout.region_offset(1, 2) == 5 * 32768
    assert layout.prefix_bytes(13) == PAGE and layout.prefix_bytes(14) == 2 * PAGE and layout.prefix_bytes(0) == 0


def test_scattered_writes_keep_their_neighbours(tmp_path, page):
    layout = RecordLayout(record_bytes=300, layers=2, batch=2, slots=100)
    with _open_pool(tmp_path, layout) as file:
        base = _records(100, 300, 0)
        file.write_records(1, 1, np.arange(100), base)
        patch = _records(4, 300, 1)
        file.write_records(1, 1, [50, 13, 14, 99], patch)  # 13 and 14 straddle a page boundary
        expected = base.copy()
        expected[[50, 13, 14, 99]] = patch
        got, nbytes = _read(file, 1, 1, np.arange(100))
        np.testing.assert_array_equal(got, expected)
        assert file.page == page and nbytes == round_up(100 * 300, page)
        other, _ = _read(file, 0, 1, np.array([5]))
        assert not other.any()  # another region was never touched
    assert not list(tmp_path.iterdir())


def test_a_second_writer_is_refused_before_it_truncates_the_file(tmp_path):
    layout = RecordLayout(record_bytes=300, layers=1, batch=1, slots=100)
    with _open_pool(tmp_path, layout) as file, IOEngine(1) as io:
        records = _records(100, 300, 0)
        file.write_records(0, 0, np.arange(100), records)
        with pytest.raises(FileInUseError, match=f"cold-pool file {file.path} is in use by kvtier process"):
            RecordFile(file.path, layout, io)
        np.testing.assert_array_equal(_read(file, 0, 0, np.arange(100))[0], records)
    assert not list(tmp_path.iterdir())  # nor is its lock left behind


def test_writes_of_records_sharing_pages_keep_every_record(tmp_path, page):
    """Runs of slots that share a page (50 and 52 lie in one page, 51 between them) are one read-modify-write."""
    layout = RecordLayout(record_bytes=300, layers=1, batch=1, slots=200)
    rng = np.random.default_rng(3)
    with IOEngine(2) as io:
        file = RecordFile(str(tmp_path / "pool"), layout, io, page_checksums=PageChecksums)
        try:
            expected = _records(200, 300, 0)
            file.write_records(0, 0, np.arange(200), expected)
            for trial in range(20):
                slots = np.array([50, 52] if trial == 0 else rng.choice(200, int(rng.integers(1, 30)), replace=False))
                patch = _records(len(slots), 300, trial + 1)
                file.write_records(0, 0, slots, patch)
                expected[slots] = patch
                got, _ = _read(file, 0, 0, np.arange(200))  # every page's checksum verified
                np.testing.assert_array_equal(got, expected)
        finally:
            file.remove()


def test_reads_return_the_order_asked_and_count_bytes(tmp_path, page):
    layout = RecordLayout(record_bytes=1536, layers=1, batch=1, slots=64)
    with _open_pool(tmp_path, layout) as file:
        data = _records(64, 1536, 2)
        file.write_records(0, 0, np.arange(64), data)
        got, nbytes = _read(file, 0, 0, np.array([40, 2, 3]))
        np.testing.assert_array_equal(got, data[[40, 2, 3]])
        # slot 40 lies in page 15; slot 2 (bytes 3072-4607) spans pages 0-1, slot 3 lies in page 1;
        # in sectors, the three records are exactly their nine sectors
        assert nbytes == (3 * PAGE if page == PAGE else 3 * 1536)


def test_scattered_fetch_bridges_short_gaps(tmp_path, page):
    layout = RecordLayout(record_bytes=2048, layers=1, batch=1, slots=16)
    with _open_pool(tmp_path, layout) as file:
        data = _records(16, 2048, 3)
        file.write_records(0, 0, np.arange(16), data)
        before = file.io.stats.snapshot()
        got, nbytes = _read(file, 0, 0, np.array([9, 0, 2, 12]))
        np.testing.assert_array_equal(got, data[[9, 0, 2, 12]])
        moved = file.io.stats.minus(before)
        if page == PAGE:  # records 0 and 2 in pages 0-1, 9 and 12 in pages 4 and 6 (page 5 bridged)
            expected, reads = 5 * PAGE, 2
        else:  # records 0-2 in one read (record 1's 2 KiB bridged), 9 and 12 alone (their gaps are 4 KiB and more)
            expected, reads = 5 * 2048, 3
        assert nbytes == expected and moved.read_calls == reads and moved.bytes_read == expected


def test_read_many_reads_every_region_in_one_parallel_read(tmp_path, page):
    layout = RecordLayout(record_bytes=1536, layers=2, batch=3, slots=64)
    with _open_pool(tmp_path, layout) as file:
        data = {seq: _records(64, 1536, 10 + seq) for seq in range(3)}
        for seq, records in data.items():
            file.write_records(1, seq, np.arange(64), records)
        requests = [(2, np.array([40, 3])), (0, np.array([], dtype=np.int64)), (1, np.array([2]))]
        before = file.io.stats.snapshot()
        results = file.read_many(1, requests)
        for (seq, slots), (got, _) in zip(requests, results):
            np.testing.assert_array_equal(got, data[seq][slots])
        expected = [2 * PAGE, 0, 2 * PAGE] if page == PAGE else [2 * 1536, 0, 1536]  # slot 2 spans pages 0-1
        assert [nbytes for _, nbytes in results] == expected
        assert file.io.stats.minus(before).bytes_read == sum(expected)
