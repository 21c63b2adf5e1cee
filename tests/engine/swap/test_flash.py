import os

import pytest
import torch

from swap_pools import GEOMETRY, clear, filled_pool, snapshot, swapped_out_then_damaged

from kvtier.errors import ChecksumError, ConfigError
from kvtier.engine.swap.flash import FlashSwap
from kvtier.engine.kv_pool import KVPool
from kvtier.storage.file_lock import FileInUseError
from kvtier.storage.flash_log import FlashFullError


def test_swap_out_then_in_restores_blocks_straight_from_pool_memory(flash_path):
    pool = filled_pool()
    swap = FlashSwap(pool, flash_path, num_slots=8, model_id="tiny", io_threads=4, segment_slots=4)
    try:
        expected = snapshot(pool, [4, 1, 3])
        pending = swap.swap_out([4, 1, 3])
        pending.wait()
        assert pending.slots == [0, 1, 2]
        clear(pool)
        swap.swap_in(pending.slots, [0, 2, 5])
        assert all(torch.equal(a, b) for a, b in zip(expected, snapshot(pool, [0, 2, 5])))
        assert swap.io.stats.bounce_copies == 0
        # 3 blocks x 2 layers x K/V x 8 KiB each way.
        assert swap.stats.out_bytes == swap.stats.in_bytes == 3 * 2 * 2 * 8192
        assert swap.allocator.live == 0
    finally:
        swap.close()


def test_consecutive_swap_outs_append_sequentially(flash_path):
    pool = filled_pool()
    swap = FlashSwap(pool, flash_path, num_slots=8, model_id="tiny", io_threads=2, segment_slots=4)
    try:
        first, second = swap.swap_out([0, 1]), swap.swap_out([2])
        first.wait(), second.wait()
        swap.swap_in(first.slots, [0, 1])
        third = swap.swap_out([3, 4])
        third.wait()
        assert (first.slots, second.slots, third.slots) == ([0, 1], [2], [3, 4])
        assert swap.allocator.sequential_share == 1.0
    finally:
        swap.close()


def test_full_flash_refuses_without_reserving(flash_path):
    pool = filled_pool()
    swap = FlashSwap(pool, flash_path, num_slots=4, model_id="tiny", io_threads=2, segment_slots=2)
    try:
        swap.swap_out([0, 1, 2]).wait()
        with pytest.raises(FlashFullError):
            swap.swap_out([3, 4])
        assert swap.allocator.live == 3
    finally:
        swap.close()


def test_the_file_is_reused_when_it_matches_and_rebuilt_when_not(flash_path):
    """A file left behind (by a killed run, or kept on purpose) is not locked: the next open takes it over."""
    pool = filled_pool()
    FlashSwap(pool, flash_path, num_slots=8, model_id="tiny", io_threads=2, keep_file=True).close()
    created = os.stat(flash_path).st_ino
    again = FlashSwap(pool, flash_path, num_slots=8, model_id="tiny", io_threads=2, keep_file=True)
    again.close()
    assert again.reused and os.stat(flash_path).st_ino == created
    other = FlashSwap(pool, flash_path, num_slots=16, model_id="tiny", io_threads=2)
    other.close()
    assert not other.reused and other.file.layout.num_blocks == 16


def test_close_deletes_the_file_and_its_lock(flash_path):
    swap = FlashSwap(filled_pool(), flash_path, num_slots=8, model_id="tiny", io_threads=2)
    assert os.path.exists(flash_path) and os.path.exists(flash_path + ".lock")
    swap.close()
    assert not os.path.exists(flash_path) and not os.path.exists(flash_path + ".lock")


def test_a_second_swap_on_the_same_file_is_refused_and_the_first_keeps_its_file(flash_path):
    pool = filled_pool()
    first = FlashSwap(pool, flash_path, num_slots=8, model_id="tiny", io_threads=2)
    try:
        first.swap_out([0]).wait()
        before = open(flash_path, "rb").read()
        with pytest.raises(FileInUseError, match=rf"{flash_path} is in use by kvtier process {os.getpid()}"):
            FlashSwap(pool, flash_path, num_slots=4, model_id="tiny", io_threads=2)  # fewer slots: would recreate
        assert open(flash_path, "rb").read() == before
    finally:
        first.close()


def test_a_corrupted_block_is_detected_on_swap_in_and_its_slots_released(flash_path):
    pool = filled_pool()
    swap = FlashSwap(pool, flash_path, num_slots=8, model_id="tiny", io_threads=2, segment_slots=4)
    try:
        pending = swapped_out_then_damaged(swap, [0, 1], layer=1, kind=1, which=1, byte=0)  # layer 1, V, block 1
        with pytest.raises(ChecksumError, match="layer 1 V block 1"):
            swap.swap_in(pending.slots, [2, 3])
        assert swap.allocator.live == 0
    finally:
        swap.close()


def test_a_pool_off_the_host_is_refused_with_a_pointer_to_the_gpu_backend(flash_path):
    pool = KVPool(GEOMETRY, 2, 16, device="meta")  # any non-CPU device: this path pwritev()s host memory
    with pytest.raises(ConfigError, match="GdsFlashSwap"):
        FlashSwap(pool, flash_path, num_slots=4, model_id="tiny")
    assert not os.path.exists(flash_path)
