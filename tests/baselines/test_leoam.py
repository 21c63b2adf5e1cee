"""LeoAM-like: variable chunks, abstracts that never under-estimate, reads of abstracts and chosen chunks only."""

import numpy as np
import torch

from baseline_runs import BLOCK_BYTES, config, greedy, ids, watch
from kvtier.baselines.chunks import ChunkTable, chunk_ends, cover, key_scores, upper_bounds
from kvtier.baselines.leoam import make_leoam_cache
from kvtier.baselines.selective_runtime import TierSetup



def test_important_regions_get_fine_chunks_and_no_chunk_crosses_a_block():
    importance = np.full((2, 96), 0.1)
    importance[1, 40:48] = 10.0  # one sequence finds tokens 40..47 important: the split serves both
    assert chunk_ends(importance, block_tokens=32, min_chunk=4) == [32, 40, 44, 48, 64, 96]
    assert chunk_ends(np.ones((1, 70)), block_tokens=32, min_chunk=4) == [32, 64, 70]


def test_the_upper_bound_never_underestimates_a_chunks_keys():
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 40, 8, generator=generator)
    table = ChunkTable(2, 2, 8, torch.float32, block_tokens=16, min_chunk=4)
    table.plan([5, 12, 16, 20, 32, 40])
    table.add(keys, first=0)
    for _ in range(20):
        query = torch.randn(2, 2, 8, generator=generator)
        bounds, exact = upper_bounds(query, table.mins, table.maxs), key_scores(query, keys)
        for chunk in range(len(table.starts)):
            tokens = torch.from_numpy(table.tokens(chunk))
            assert (exact[:, tokens] <= bounds[:, chunk : chunk + 1] + 1e-5).all()


def test_generated_tokens_form_small_chunks_and_full_blocks_of_abstracts_leave_dram():
    keys = torch.arange(2 * 30 * 2, dtype=torch.float32).reshape(1, 2, 30, 2)
    table = ChunkTable(1, 2, 2, torch.float32, block_tokens=8, min_chunk=3)
    table.plan([8, 10])
    table.add(keys[:, :, :10], first=0)
    for token in range(10, 30):  # decode: one token at a time
        table.add(keys[:, :, token : token + 1], first=token)
    assert table.ends.tolist() == [8, 10, 13, 16, 19, 22, 24, 27, 30]  # min_chunk tokens, cut at block ends
    assert table.sizes().tolist() == [8, 2, 3, 3, 3, 3, 2, 3, 3]
    one_by_one = table.mins.clone()
    mins, maxs = table.take_full_blocks()  # 9 closed chunks: one block of 8 abstracts goes to disk
    assert mins.shape[2] == 8 and table.flushed == 8 and table.mins.shape[2] == 1
    assert torch.equal(mins, one_by_one[:, :, :8])
    assert torch.equal(maxs[:, :, 2], keys[:, :, 12])  # chunk [10, 13) of increasing keys: max is its last token


def test_chunks_are_taken_best_first_until_they_hold_enough_tokens():
    bounds = np.array([[5.0, 1.0, 9.0, 3.0], [0.0, 2.0, 1.0, 3.0]])
    sizes = np.array([4, 4, 2, 8])
    chosen = cover(bounds, sizes, tokens=5)
    assert [c.tolist() for c in chosen] == [[2, 0], [3]]
    assert [len(c) for c in cover(bounds, sizes, tokens=0)] == [0, 0]


def test_each_step_reads_the_abstracts_and_the_chosen_chunks_only(tiny_llama, tmp_path):
    prompt, block = ids(2, 300, 4), 16  # 2 KiB blocks in 4 KiB strides; a block of abstracts holds 16 chunks
    kv_config = config("leoam", tmp_path, tiny_llama, 304, batch=2)
    setup = TierSetup(kv_config.sparse_settings(), 304, 2, tmp_path, kv_config.device_kv_budget,
                      kv_config.host_kv_budget, (0, 1), block, 2)
    cache = make_leoam_cache(tiny_llama, setup, min_chunk=2)
    seen = watch(cache, also=lambda layer: layer.abstracts.stored_blocks[layer.layer_idx])
    try:
        greedy(tiny_llama, cache, prompt, 4)
    finally:
        cache.close()
    abstract_blocks = [step.extra for step in seen]  # per sequence; K region (mins) and V region (maxs)
    chosen_blocks = sum(step.disk_blocks for step in seen)  # K and V of each
    prefetched = cache.layers[0].abstracts.stored_blocks[0]  # the last step prefetched layer 0's abstracts
    assert min(abstract_blocks) > 0 and chosen_blocks > 0
    expected = 2 * 2 * (sum(abstract_blocks) + prefetched) + 2 * chosen_blocks
    assert cache.io_stats().bytes_read == expected * BLOCK_BYTES
    all_blocks = sum(2 * step.stored_tokens // block for step in seen)
    assert chosen_blocks < all_blocks
