"""Scattered reads through kernel AIO (and the thread-pool fallback): the bytes of the file, errors named."""

import os

import numpy as np
import pytest

from kvtier.errors import StorageError
from kvtier.storage import PAGE, IOEngine, aligned_buffer, open_direct
from kvtier.storage import io_engine as io_engine_module
from kvtier.storage.kernel_aio import MAX_EVENTS, KernelAio

PAGES = 2000


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "data.bin"
    content = np.random.default_rng(0).integers(0, 256, PAGES * PAGE, dtype=np.uint8)
    path.write_bytes(content.tobytes())
    fd, _ = open_direct(str(path), os.O_RDONLY)
    yield fd, content
    os.close(fd)


@pytest.fixture(params=["kernel-aio", "threads"])
def engine(request, monkeypatch):
    if request.param == "threads":
        monkeypatch.setattr(io_engine_module.KernelAio, "open", classmethod(lambda cls: None))
    elif KernelAio.open() is None:
        pytest.skip("kernel AIO is not available on this machine")
    with IOEngine(4) as io:
        assert io.backend == request.param
        yield io


def _runs(pages, lengths):
    offsets = np.asarray(pages, dtype=np.int64) * PAGE
    lengths = np.asarray(lengths, dtype=np.int64) * PAGE
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return offsets, lengths, starts


def test_scattered_runs_land_where_asked(engine, data_file):
    fd, content = data_file
    offsets, lengths, starts = _runs([1500, 3, 700, 701], [2, 1, 1, 3])
    buffer = aligned_buffer(int(lengths.sum()))
    engine.submit_scattered(fd, offsets, lengths, buffer, starts).wait()
    for offset, length, start in zip(offsets, lengths, starts):
        assert np.array_equal(buffer[start : start + length], content[offset : offset + length])
    assert engine.stats.bytes_read == int(lengths.sum())


def test_more_reads_than_the_queue_holds(engine, data_file):
    fd, content = data_file
    pages = np.random.default_rng(1).permutation(PAGES)[: MAX_EVENTS + 300]
    offsets, lengths, starts = _runs(pages, np.ones(len(pages)))
    buffer = aligned_buffer(len(pages) * PAGE)
    pending = engine.submit_scattered(fd, offsets, lengths, buffer, starts)
    pending.wait()
    assert np.array_equal(buffer.reshape(-1, PAGE), content.reshape(-1, PAGE)[pages])


def test_a_read_past_the_end_says_the_file_is_truncated(engine, data_file):
    fd, _ = data_file
    offsets, lengths, starts = _runs([PAGES - 1], [2])
    with pytest.raises(StorageError, match="truncated"):
        engine.submit_scattered(fd, offsets, lengths, aligned_buffer(2 * PAGE), starts).wait()
    offsets, lengths, starts = _runs([0], [1])  # the engine stays usable
    engine.submit_scattered(fd, offsets, lengths, aligned_buffer(PAGE), starts).wait()


def test_a_run_past_the_buffer_is_refused(engine, data_file):
    fd, _ = data_file
    offsets, lengths, starts = _runs([0], [2])
    with pytest.raises(ValueError, match="past the end of its buffer"):
        engine.submit_scattered(fd, offsets, lengths, aligned_buffer(PAGE), starts).wait()


def test_runs_into_separate_buffers_in_one_batch(engine, data_file):
    fd, content = data_file
    buffers = [aligned_buffer(PAGE), aligned_buffer(3 * PAGE)]
    engine.read_runs_batched(fd, [(9 * PAGE, [memoryview(buffers[0])]), (100 * PAGE, [memoryview(buffers[1])])])
    assert np.array_equal(buffers[0], content[9 * PAGE : 10 * PAGE])
    assert np.array_equal(buffers[1], content[100 * PAGE : 103 * PAGE])


def test_a_submission_that_cannot_be_queued_leaves_the_engine_usable(engine, data_file, monkeypatch):
    fd, content = data_file
    offsets, lengths, starts = _runs([4], [1])

    def refuse(*args, **kwargs):
        raise RuntimeError("cannot schedule new futures after shutdown")

    with monkeypatch.context() as patch:
        patch.setattr(engine._pool, "submit", refuse)
        with pytest.raises(RuntimeError, match="shutdown"):
            engine.submit_scattered(fd, offsets, lengths, aligned_buffer(PAGE), starts)
    assert not engine._aio_lock.locked()  # else the next kernel AIO batch would wait forever
    buffer = aligned_buffer(PAGE)
    engine.submit_scattered(fd, offsets, lengths, buffer, starts).wait()
    assert np.array_equal(buffer, content[4 * PAGE : 5 * PAGE])
