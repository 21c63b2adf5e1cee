import os
from concurrent.futures import Future

import numpy as np
import pytest

from kvtier.errors import ConfigError, StorageError
from kvtier.storage import io_engine
from kvtier.storage.aligned import aligned_buffer
from kvtier.storage.geometry import PAGE
from kvtier.storage.io_engine import IOEngine, IOStats, consecutive_spans, gather, then


@pytest.fixture
def engine():
    with IOEngine(threads=4) as engine:
        yield engine


@pytest.fixture
def file_fd(tmp_path):
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    yield fd
    os.close(fd)


def _pages(rng, count):
    buf = aligned_buffer(count * PAGE)
    buf[:] = rng.integers(0, 256, buf.nbytes, dtype=np.uint8)
    return buf


def test_runs_round_trip_with_one_syscall_per_run(engine, file_fd, rng):
    sources = [_pages(rng, 1) for _ in range(6)]
    runs = [(0, [memoryview(s) for s in sources[:3]]), (10 * PAGE, [memoryview(s) for s in sources[3:]])]
    engine.write_runs(file_fd, runs)
    targets = [aligned_buffer(PAGE) for _ in range(6)]
    engine.read_runs(file_fd, [(0, [memoryview(t) for t in targets[:3]]),
                               (10 * PAGE, [memoryview(t) for t in targets[3:]])])
    assert all((s == t).all() for s, t in zip(sources, targets))
    assert engine.stats.snapshot() == IOStats(bytes_read=6 * PAGE, bytes_written=6 * PAGE, read_calls=2,
                                              write_calls=2, bounce_copies=0)


def test_many_runs_spread_over_threads(engine, file_fd, rng):
    source = _pages(rng, 64)
    engine.write_runs(file_fd, [(i * PAGE, [memoryview(source[i * PAGE:(i + 1) * PAGE])]) for i in range(64)])
    target = aligned_buffer(64 * PAGE)
    order = rng.permutation(64)
    engine.read_runs(file_fd, [(int(i) * PAGE, [memoryview(target[i * PAGE:(i + 1) * PAGE])]) for i in order])
    assert (source == target).all()
    assert engine.stats.read_calls == 64 and engine.stats.write_calls == 64


def test_async_read(engine, file_fd, rng):
    source = _pages(rng, 4)
    engine.write_runs(file_fd, [(0, [memoryview(source)])])
    target = aligned_buffer(4 * PAGE)
    future = engine.submit_read_runs(file_fd, [(0, [memoryview(target[:2 * PAGE])]),
                                               (2 * PAGE, [memoryview(target[2 * PAGE:])])])
    assert future.result(timeout=10) is None
    assert (source == target).all()


def test_async_write(engine, file_fd, rng):
    source = _pages(rng, 2)
    assert engine.submit_write_runs(file_fd, [(PAGE, [memoryview(source)])]).result(timeout=10) is None
    target = aligned_buffer(2 * PAGE)
    assert os.preadv(file_fd, [target], PAGE) == 2 * PAGE
    assert (source == target).all()
    assert engine.stats.bytes_written == 2 * PAGE


def test_short_transfers_are_resumed(engine, tmp_path, monkeypatch):
    fd = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT)
    try:
        os.pwrite(fd, bytes(range(250)) * 4, 0)
        real_preadv = os.preadv

        def preadv_at_most_100(fd, buffers, offset):
            limited, left = [], 100
            for buffer in buffers:
                limited.append(buffer[:left])
                left -= len(limited[-1])
            return real_preadv(fd, [view for view in limited if len(view)], offset)

        monkeypatch.setattr(os, "preadv", preadv_at_most_100)
        parts = [bytearray(130), bytearray(570), bytearray(300)]
        engine.read_runs(fd, [(0, [memoryview(part) for part in parts])])
    finally:
        os.close(fd)
    assert b"".join(parts) == bytes(range(250)) * 4
    assert engine.stats.read_calls == 10 and engine.stats.bytes_read == 1000


def test_runs_longer_than_iov_max_are_split(engine, tmp_path):
    fd = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT)
    try:
        pieces = [bytes([i % 256]) * 8 for i in range(io_engine.IOV_MAX + 10)]
        engine.write_runs(fd, [(0, [memoryview(piece) for piece in pieces])])
        assert os.pread(fd, 8 * len(pieces), 0) == b"".join(pieces)
    finally:
        os.close(fd)
    assert engine.stats.write_calls == 2


def test_reading_past_end_of_file_names_the_file(engine, tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(StorageError, match=rf"{path}: unexpected end of file at offset 100 .* 50 more bytes"):
            engine.read_runs(fd, [(0, [memoryview(bytearray(150))])])
    finally:
        os.close(fd)


def test_os_errors_become_storage_errors(engine, tmp_path):
    path = tmp_path / "readonly"
    path.write_bytes(b"x" * PAGE)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(StorageError, match=rf"{path}: write failed at offset 0: Bad file descriptor"):
            engine.write_runs(fd, [(0, [memoryview(b"y" * 10)])])
    finally:
        os.close(fd)


def test_full_disk_raises_storage_error(engine, full_disk):
    fd = os.open(full_disk / "big", os.O_RDWR | os.O_CREAT)
    try:
        chunk = memoryview(bytes(256 * 1024))
        with pytest.raises(StorageError, match="no space left on the device .* free space in"):
            engine.write_runs(fd, [(i * chunk.nbytes, [chunk]) for i in range(8)])
    finally:
        os.close(fd)


def test_threads_must_be_positive():
    with pytest.raises(ConfigError, match="positive integer"):
        IOEngine(threads=0)


def test_stats_snapshot_and_minus():
    stats = IOStats()
    stats.add(bytes_read=10, read_calls=1)
    before = stats.snapshot()
    stats.add(bytes_read=5, read_calls=1, bounce_copies=2)
    assert before.bytes_read == 10
    assert stats.minus(before) == IOStats(bytes_read=5, read_calls=1, bounce_copies=2)


def test_gather_waits_for_all_and_reports_the_first_error():
    first, second = Future(), Future()
    combined = gather([first, second])
    first.set_exception(StorageError("first"))
    assert not combined.done()
    second.set_result(None)
    with pytest.raises(StorageError, match="first"):
        combined.result(timeout=1)
    assert gather([]).result(timeout=1) is None


def test_then_runs_step_after_success_only():
    done = Future()
    chained = then(done, lambda: 42)
    done.set_result(None)
    assert chained.result(timeout=1) == 42
    failed = Future()
    calls = []
    chained = then(failed, lambda: calls.append(1))
    failed.set_exception(OSError("boom"))
    with pytest.raises(OSError, match="boom"):
        chained.result(timeout=1)
    assert calls == []


def test_then_delivers_errors_of_the_step():
    done = Future()
    done.set_result(None)

    def step():
        raise StorageError("verify failed")

    with pytest.raises(StorageError, match="verify failed"):
        then(done, step).result(timeout=1)


@pytest.mark.parametrize("numbers, spans", [
    ([], []),
    ([5], [(0, 1)]),
    ([1, 2, 3, 7, 8, 10], [(0, 3), (3, 5), (5, 6)]),
    ([4, 4, 5], [(0, 1), (1, 3)]),
])
def test_consecutive_spans(numbers, spans):
    assert [(span.start, span.stop) for span in consecutive_spans(numbers)] == spans
