import pytest
import torch

from kvtier.engine.swap.dram import DramSwap
from kvtier.engine.kv_pool import KVPool
from kvtier.storage import KVGeometry
from kvtier.storage.flash_log import FlashFullError


def test_round_trip_through_host_slots_reuses_lowest_free_slots():
    pool = KVPool(KVGeometry(3, 2, 16, "float32"), num_blocks=5, block_tokens=16)
    for layer in range(3):
        for kind in (0, 1):
            pool.blocks[layer][kind].copy_(torch.randn(pool.blocks[layer][kind].shape))
    expected = [pool.blocks[layer][kind][[3, 0]].clone() for layer in range(3) for kind in (0, 1)]
    swap = DramSwap(pool, num_slots=4, threads=2)
    try:
        first = swap.swap_out([3, 0])
        first.wait()
        assert first.slots == [0, 1]
        swap.swap_in(first.slots, [1, 4])
        got = [pool.blocks[layer][kind][[1, 4]] for layer in range(3) for kind in (0, 1)]
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
        second = swap.swap_out([2])
        second.wait()
        assert second.slots == [0]  # vLLM's free list: the lowest slot again, not the next one
        with pytest.raises(FlashFullError):
            swap.swap_out([0, 1, 3, 4])
        assert swap.stats.out_blocks == 3 and swap.stats.in_blocks == 2
    finally:
        swap.close()
