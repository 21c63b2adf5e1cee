import os
import numpy as np
import pytest
import torch

from kvtier.errors import ChecksumError
from kvtier.sparse.cold.cold_pool import ColdPool
from kvtier.sparse.protocol import Channel, ChannelSpec
from kvtier.sparse.cold.sketch import SketchFormat
from kvtier.storage import PAGE, SECTOR, IOEngine


@pytest.fixture()
def cold(tmp_path):
    channel = Channel.create(ChannelSpec(2, 1, 2, 1, 32, 50, kv_record_bytes=2 * 2 * 32 * 4))
    with IOEngine(2) as io:
        pool = ColdPool(str(tmp_path), 1, 2, 50, 2, 32, torch.float32, SketchFormat(8, 2, 32), io, channel)
        yield pool
        pool.close()
    channel.close()


def test_append_fetch_round_trip_and_empty_fetch(cold):
    keys, values = torch.randn(2, 2, 10, 32), torch.randn(2, 2, 10, 32)
    cold.append(0, keys, values, np.arange(10)[None, :].repeat(2, axis=0) + 5)
    assert list(cold.used) == [10] and cold.positions[0, 1, :3].tolist() == [5, 6, 7]
    got_keys, got_values, nbytes = cold.fetch(0, 1, np.array([2, 7]))
    torch.testing.assert_close(got_keys, keys[1][:, [2, 7]])
    torch.testing.assert_close(got_values, values[1][:, [2, 7]])
    # 512-byte records: slots 2 and 7 are sectors 2 and 7 (3-6 bridged), or both in page 0 where O_DIRECT moves
    # only whole pages
    assert nbytes == (6 * SECTOR if cold.kv.page == SECTOR else PAGE)
    empty_keys, empty_values, nbytes = cold.fetch(0, 0, np.array([], dtype=np.int64))
    assert empty_keys.shape == (2, 0, 32) and empty_values.shape == (2, 0, 32) and nbytes == 0


def _flip_byte(path, offset):
    """Damage the file behind the pool's back (as a failing disk would)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)


def test_a_damaged_record_is_reported(cold):
    cold.append(0, torch.randn(2, 2, 4, 32), torch.randn(2, 2, 4, 32), np.arange(4)[None, :].repeat(2, axis=0))
    layout = cold.kv.layout
    _flip_byte(cold.kv.path, layout.region_offset(0, 0) + layout.record_bytes + 7)  # inside slot 1
    with pytest.raises(ChecksumError, match=rf"layer 0 sequence 0: checksum mismatch in data page {512 // cold.kv.page} "):
        cold.fetch(0, 0, np.array([1]))
    cold.fetch(0, 1, np.array([1]))  # the other sequence's region is intact


def test_a_write_next_to_a_damaged_record_is_refused(cold):
    """A read-modify-write must not re-checksum damaged neighbours into 'valid' pages."""
    cold.append(0, torch.randn(2, 2, 4, 32), torch.randn(2, 2, 4, 32), np.arange(4)[None, :].repeat(2, axis=0))
    _flip_byte(cold.kv.path, cold.kv.layout.region_offset(0, 0) + 5)  # inside slot 0, same page as slot 2
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        cold.replace(0, 0, np.array([2]), torch.randn(2, 1, 32), torch.randn(2, 1, 32), np.array([9]))


def test_fetch_many_returns_each_sequences_tokens(cold):
    keys, values = torch.randn(2, 2, 10, 32), torch.randn(2, 2, 10, 32)
    cold.append(0, keys, values, np.arange(10)[None, :].repeat(2, axis=0))
    slots = [np.array([9, 1]), np.array([4])]
    fetched = cold.fetch_many(0, slots)
    assert fetched.counts.tolist() == [2, 1] and fetched.keys.shape == (2, 2, 2, 32)
    for seq in range(2):
        got_keys, got_values = fetched.of(seq)
        torch.testing.assert_close(got_keys, keys[seq][:, slots[seq]])
        torch.testing.assert_close(got_values, values[seq][:, slots[seq]])
    assert not fetched.keys[1, :, 1].any() and not fetched.values[1, :, 1].any()  # the padding: zeros


def test_later_writes_are_published_when_settled(cold):
    keys, values = torch.randn(2, 2, 6, 32), torch.randn(2, 2, 6, 32)
    timed = []
    cold.append_later(0, keys, values, np.arange(6)[None, :].repeat(2, axis=0), timed.append)
    cold.replace_later(0, 1, np.array([4]), keys[0][:, :1], values[0][:, :1], np.array([40]), timed.append)
    cold.settle(0)
    assert list(cold.used) == [6] and cold.positions[0, 1, 4] == 40 and len(timed) == 2 and min(timed) > 0
    got_keys, got_values, _ = cold.fetch(0, 1, np.array([3, 4]))
    torch.testing.assert_close(got_keys, torch.cat([keys[1][:, 3:4], keys[0][:, :1]], dim=1))
    torch.testing.assert_close(got_values, torch.cat([values[1][:, 3:4], values[0][:, :1]], dim=1))


def test_a_failed_later_write_is_raised_when_its_layer_is_settled(cold):
    cold.append(0, torch.randn(2, 2, 4, 32), torch.randn(2, 2, 4, 32), np.arange(4)[None, :].repeat(2, axis=0))
    _flip_byte(cold.kv.path, cold.kv.layout.region_offset(0, 0) + 5)
    cold.replace_later(0, 0, np.array([2]), torch.randn(2, 1, 32), torch.randn(2, 1, 32), np.array([9]))
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        cold.settle(0)
    cold.settle(0)  # reported once; nothing else pending
