"""Quest-like: 16-token pages, their key mins and maxs in DRAM, the pages with the highest bounds attended."""

import numpy as np
import pytest
import torch

from baseline_runs import SINK, config, greedy, ids, watch
from kvtier.baselines.chunks import cover
from kvtier.baselines.quest import PageTable
from kvtier.baselines.selective import grouped_query
from kvtier.errors import ConfigError
from kvtier.modes import KVConfig, make_cache
from kvtier.storage.pages import pages_holding


def _keys(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 2, tokens, 4, generator=torch.Generator().manual_seed(seed))


def test_the_page_table_holds_each_pages_key_mins_and_maxs_however_tokens_arrive():
    keys = _keys(40)
    at_once, one_by_one = PageTable(2, 2, 4, torch.float32, 64), PageTable(2, 2, 4, torch.float32, 64)
    at_once.add(keys, first=0)
    for token in range(40):
        one_by_one.add(keys[:, :, token : token + 1], first=token)
    for table in (at_once, one_by_one):
        assert table.pages == 3 and table.sizes().tolist() == [16, 16, 8]
        for page, (start, stop) in enumerate([(0, 16), (16, 32), (32, 40)]):
            assert torch.equal(table.mins[:, :, page], keys[:, :, start:stop].amin(dim=2))
            assert torch.equal(table.maxs[:, :, page], keys[:, :, start:stop].amax(dim=2))
        assert table.tokens(2).tolist() == list(range(32, 40))
    with pytest.raises(ValueError, match="in order"):
        at_once.add(keys[:, :, :1], first=41)


def test_the_bound_is_quests_per_head_bound_summed_and_never_underestimates():
    keys = _keys(48, seed=1)
    table = PageTable(2, 2, 4, torch.float32, 48)
    table.add(keys, first=0)
    grouped = torch.randn(2, 2, 3, 4, generator=torch.Generator().manual_seed(2))  # 2 KV heads x 3 query heads
    bounds = table.bounds(grouped)
    for page in range(3):
        low, high = table.mins[:, :, page, None, :], table.maxs[:, :, page, None, :]  # [B, H, 1, D]
        by_hand = torch.maximum(grouped * low, grouped * high).sum(dim=(1, 2, 3))
        torch.testing.assert_close(bounds[:, page], by_hand)
        exact = torch.einsum("bhgd,bhnd->bn", grouped, keys[:, :, page * 16 : (page + 1) * 16])
        assert (exact <= bounds[:, page : page + 1] + 1e-5).all()


def test_the_pages_with_the_highest_bounds_are_taken_first():
    keys = torch.zeros(1, 1, 64, 2)
    keys[0, 0, 40] = torch.tensor([3.0, -3.0])  # page 2: the query's direction, far out (bound 6)
    keys[0, 0, 5] = torch.tensor([1.0, -1.0])  # page 0: the same direction, nearer (2)
    keys[0, 0, 60] = torch.tensor([0.5, -0.5])  # page 3: nearer still (1)
    keys[0, 0, 20] = torch.tensor([-5.0, 5.0])  # page 1: the largest key, against the query (0)
    table = PageTable(1, 1, 2, torch.float32, 64)
    table.add(keys, first=0)
    bounds = table.bounds(torch.tensor([[[[1.0, -1.0]]]])).numpy()
    assert np.argsort(-bounds[0]).tolist() == [2, 0, 3, 1]
    assert [chosen.tolist() for chosen in cover(bounds, table.sizes(), tokens=20)] == [[2, 0]]


def test_each_step_attends_the_pages_with_the_highest_bounds_the_last_one_cut(tiny_llama, tmp_path):
    cache = make_cache(tiny_llama, config("quest", tmp_path, tiny_llama, 205, alpha=0.25), 205)
    steps = []
    for layer in cache.layers:
        def spy(query, scaling, layer=layer, select=layer.select):
            bounds = layer.pages.bounds(grouped_query(query, layer.pages.mins.shape[1]))[0].numpy()
            chosen = select(query, scaling)
            steps.append((bounds, chosen.index[0], layer.pages.sizes(), layer.selection_size()))
            return chosen

        layer.select = spy
    try:
        greedy(tiny_llama, cache, ids(1, 200, 7), steps=5)
    finally:
        cache.close()
    assert len(steps) == 2 * 5
    for bounds, index, sizes, size in steps:
        pages = np.unique(index // 16)
        assert len(index) == size
        assert set(pages) == set(np.argsort(-bounds, kind="stable")[: len(pages)])  # the best pages, no other
        cut = [page for page in pages if np.count_nonzero(index // 16 == page) < sizes[page]]
        assert len(cut) <= 1


def test_only_the_chosen_pages_are_read(tiny_llama, tmp_path):
    kv_config = config("quest", tmp_path, tiny_llama, 254, alpha=0.1, batch=2)
    cache = make_cache(tiny_llama, kv_config, 254, 2)
    seen = watch(cache, also=lambda layer: layer.runtime.kv.file.page_bytes)
    try:
        greedy(tiny_llama, cache, ids(2, 250, 3), 4)
    finally:
        cache.close()
    chosen_bytes = sum(_page_bytes(step) for step in seen)
    all_bytes = sum(2 * step.stored_tokens * 128 for step in seen)
    assert cache.io_stats().bytes_read == 2 * chosen_bytes  # K and V of the chosen pages on disk, nothing to choose
    assert 0 < chosen_bytes < all_bytes


def _page_bytes(step) -> int:
    """Bytes of the file's read units holding every stored token of the Quest pages a step attended (the cut page
    whole: it is read before it is cut), summed over sequences."""
    total = 0
    for positions in step.positions:
        pages = np.unique((positions[positions >= SINK] - SINK) // 16)
        tokens = np.concatenate([np.arange(page * 16, page * 16 + 16) for page in pages])
        total += len(pages_holding(tokens[tokens < step.stored_tokens], 128, page=step.extra)) * step.extra
    return total


def test_a_host_budget_below_the_page_table_is_refused(tiny_llama, tmp_path):
    kv_config = KVConfig(kv="quest", device_kv_budget="1MiB", host_kv_budget="8KiB", storage_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"cannot hold Quest's page table .* raise host_kv_budget \(--host"):
        make_cache(tiny_llama, kv_config, 1000)
    assert not list(tmp_path.iterdir())
