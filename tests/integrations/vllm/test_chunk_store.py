"""FlashChunkStore on its own: journal compaction keeps restarts bounded, in-flight chunks block reclaiming."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier.errors import ConfigError, StorageError
from kvtier.integrations.vllm.chunk_store import COMPACT_RECORDS_PER_SLOT, FlashChunkStore
from kvtier.storage import aligned_buffer
from kvtier.storage.flash_log import FlashFullError

CHUNK = 4096


def chunks(count: int, seed: int = 0) -> np.ndarray:
    rows = aligned_buffer(count * CHUNK).reshape(count, CHUNK)
    rows[:] = np.random.default_rng(seed).integers(0, 256, rows.shape, dtype=np.uint8)
    return rows


def open_store(path, **options):
    return FlashChunkStore(path, CHUNK, 16 * CHUNK, {"model": "m"}, io_threads=2, segment_chunks=4, **options)


def test_the_journal_is_compacted_and_a_restart_still_finds_the_newest(tmp_path):
    store, rows = open_store(tmp_path / "f"), chunks(8)
    for round_ in range(600):  # 4800 stores through 16 slots
        keys = [b"%d-%d" % (round_, i) for i in range(8)]
        assert store.store(keys, list(rows)).result() == keys
    assert store.stats()["journal_records"] <= COMPACT_RECORDS_PER_SLOT * 16 + 1024 + 16
    store.close()
    again = open_store(tmp_path / "f", fsync=True)
    assert sorted(k for r in (598, 599) for k in (b"%d-%d" % (r, i) for i in range(8))) == sorted(
        k for r in range(600) for k in (b"%d-%d" % (r, i) for i in range(8)) if k in again)
    out = aligned_buffer(8 * CHUNK).reshape(8, CHUNK)
    outcome = again.load([b"599-%d" % i for i in range(8)], list(out)).result()
    assert len(outcome.loaded) == 8 and np.array_equal(out, rows)
    again.close()


def test_a_segment_still_being_read_is_not_reclaimed(tmp_path):
    store, rows = open_store(tmp_path / "f"), chunks(16)
    store.store([b"%d" % i for i in range(16)], list(rows)).result()
    store._pin([0])  # a load of slot 0 in flight
    with pytest.raises(FlashFullError, match="still being read or written"):
        store.store([b"new"], [rows[0]]).result()
    assert b"0" in store
    store._unpin([0])
    assert store.store([b"new"], [rows[0]]).result() == [b"new"]
    assert b"0" not in store and store.stats()["dropped_chunks"] == 4
    store.close()


def test_keys_already_stored_or_repeated_are_written_once(tmp_path):
    store, rows = open_store(tmp_path / "f"), chunks(3)
    assert store.store([b"a", b"b", b"a"], list(rows)).result() == [b"a", b"b"]
    assert store.store([b"b", b"c"], list(rows[:2])).result() == [b"c"]
    assert store.stats()["stored_chunks"] == 3
    store.close()


def test_chunks_must_be_whole_pages():
    with pytest.raises(ConfigError, match="multiple of 4096"):
        FlashChunkStore("/nonexistent/f", 1000, 1 << 20, {})


def test_fsync_mode_stores_and_finds_chunks_after_a_reopen(tmp_path):
    store, rows = open_store(tmp_path / "f", fsync=True), chunks(4)
    assert store.store([b"a", b"b", b"c", b"d"], list(rows)).result() == [b"a", b"b", b"c", b"d"]
    store.close()
    again, out = open_store(tmp_path / "f"), aligned_buffer(4 * CHUNK).reshape(4, CHUNK)
    assert again.load([b"a", b"b", b"c", b"d"], list(out)).result().loaded == [b"a", b"b", b"c", b"d"]
    assert np.array_equal(out, rows)
    again.close()


def test_a_failed_write_fails_the_store_and_frees_its_slots(tmp_path):
    store, rows = open_store(tmp_path / "f"), chunks(2)
    writable = os.dup(store.file.fd)
    readonly = os.open(tmp_path / "f", os.O_RDONLY)
    os.dup2(readonly, store.file.fd)  # the device now refuses writes (EBADF) under the store's feet
    with pytest.raises(StorageError, match="write failed"):
        store.store([b"a", b"b"], list(rows)).result()
    assert b"a" not in store and store.log.live == 0
    os.dup2(writable, store.file.fd)
    assert store.store([b"a", b"b"], list(rows)).result() == [b"a", b"b"]
    store.close()
    os.close(writable)
    os.close(readonly)
