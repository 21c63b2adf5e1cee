import numpy as np
import torch

from kvtier.sparse.hot.hot_pool import HotPool


def _pool(tokens=10):
    pool = HotPool(batch=2, heads=2, head_dim=4, dtype=torch.float32)
    keys = torch.arange(2 * 2 * tokens * 4, dtype=torch.float32).reshape(2, 2, tokens, 4)
    pool.append(keys, -keys, np.arange(tokens)[None, :].repeat(2, axis=0) + 100)
    return pool, keys


def test_scores_are_raw_inner_products_summed_or_maxed_over_heads():
    pool, keys = _pool()
    # Small integers: every product and sum is exact in float32, so the comparison cannot depend on the
    # summation order (a random float query made near-cancelling sums fail the tolerance now and then).
    query = torch.randint(-3, 4, (2, 2, 1, 4), generator=torch.Generator().manual_seed(0)).float()
    expected = torch.einsum("bhqd,bhtd->bt", query, keys)
    torch.testing.assert_close(pool.score(query, "sum"), expected)
    per_head = torch.einsum("bhqd,bhtd->bht", query, keys)
    torch.testing.assert_close(pool.score(query, "max"), per_head.amax(dim=1))


def test_take_removes_per_sequence_slots_and_compacts():
    pool, keys = _pool()
    taken_keys, taken_values, positions = pool.take(np.array([[1, 4], [0, 9]]))
    assert positions.tolist() == [[101, 104], [100, 109]]
    torch.testing.assert_close(taken_keys[1], keys[1][:, [0, 9]])
    torch.testing.assert_close(taken_values[0], -keys[0][:, [1, 4]])
    assert pool.used == 8
    assert pool.positions[0, :8].tolist() == [100, 102, 103, 105, 106, 107, 108, 109]
    torch.testing.assert_close(pool.keys_of(1, np.arange(8)), keys[1][:, 1:9])


def test_replace_and_growth():
    pool, _ = _pool(3)
    pool.append(torch.zeros(2, 2, 70, 4), torch.zeros(2, 2, 70, 4), np.full((2, 70), 7))
    assert pool.used == 73 and pool.capacity >= 73
    pool.replace(1, np.array([2]), torch.ones(2, 1, 4), torch.ones(2, 1, 4), np.array([555]))
    assert pool.positions[1, 2] == 555 and pool.keys_of(1, np.array([2])).eq(1).all()
    assert pool.positions[0, 2] == 102


def test_reserve_makes_exact_room_that_appends_then_fill_without_growing():
    pool, _ = _pool(3)
    pool.reserve(80)
    assert pool.capacity == 80 and pool.used == 3
    key_tiles = pool.key_tiles
    pool.append(torch.ones(2, 2, 77, 4), torch.ones(2, 2, 77, 4), np.full((2, 77), 9))
    assert pool.key_tiles is key_tiles and pool.used == 80  # filled in place: no copy of the pool
    pool.append(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4), np.full((2, 1), 10))
    assert pool.capacity == 160 and pool.positions[0, 80] == 10  # past it, appends double the room
    pool.reserve(10)
    assert pool.capacity == 160  # never shrinks


def test_keys_cross_tiles_and_come_back_as_they_went_in():
    pool, keys = _pool(37)  # two full tiles and a part
    rows = torch.tensor([[0, 15, 16, 36], [36, 17, 1, 31]])
    gathered_keys, gathered_values = pool.gather(rows)
    for seq in range(2):
        torch.testing.assert_close(gathered_keys[seq], keys[seq][:, rows[seq]])
        torch.testing.assert_close(gathered_values[seq], -keys[seq][:, rows[seq]])
        torch.testing.assert_close(pool.keys_of(seq, np.arange(37)), keys[seq])


def test_a_pool_grows_in_whole_tiles():
    pool = HotPool(batch=1, heads=1, head_dim=4, dtype=torch.float32, reserve=17)
    assert pool.capacity == 32 and pool.key_tiles.shape == (1, 1, 2, 4, 16)
