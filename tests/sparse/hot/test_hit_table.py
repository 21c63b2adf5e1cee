import numpy as np
import pytest

from kvtier.sparse.hot.hit_table import OLDEST, HitTable

EVERY = slice(None)


def test_two_bytes_per_token():
    assert HitTable(batch=3, capacity=1000).nbytes == 2 * 3 * 1000


def test_record_counts_hits_and_idle_steps_with_decay():
    table = HitTable(batch=1, capacity=8, decay_every=4)
    table.record(np.array([[1, 2]]))
    table.record(np.array([[2, 3]]))
    assert table.hits[0, :6].tolist() == [0, 1, 2, 1, 0, 0]
    assert table.idle(0, np.arange(6)).tolist() == [2, 1, 0, 0, 2, 2]
    table.record(np.array([[2, 3]]))
    table.record(np.array([[2, 3]]))  # 4th step: hits halve
    assert table.hits[0, :4].tolist() == [0, 0, 2, 1]


def test_a_step_writes_only_the_selected_tokens():
    table = HitTable(batch=1, capacity=1000)
    before = table.stamp.copy()
    table.record(np.array([[5, 700]]))
    assert np.flatnonzero(table.stamp[0] != before[0]).tolist() == [5, 700]


def test_hits_saturate_and_idle_saturates_without_wrapping():
    table = HitTable(batch=1, capacity=2, decay_every=10_000)
    idle = []
    for _ in range(1000):
        table.record(np.array([[0]]))
        idle.append(int(table.idle(0, np.array([1]))[0]))
    assert table.hits[0, 0] == 255
    assert idle[:OLDEST] == list(range(1, OLDEST + 1))  # exact while young
    assert min(idle[OLDEST:]) >= OLDEST  # then saturated, never back to small counts
    assert table.idle(0, np.array([0]))[0] == 0


def test_seed_sets_hits_and_resets_idle():
    table = HitTable(batch=2, capacity=5)
    table.record(np.array([[0], [0]]))
    table.seed(np.array([[3, 4], [1, 2]]), np.array([[1, 0], [2, 2]]))
    assert table.hits.tolist() == [[1, 0, 0, 1, 0], [1, 2, 2, 0, 0]]
    assert table.idle(EVERY, EVERY)[:, 1:].tolist() == [[1, 1, 0, 0], [0, 0, 1, 1]]
    assert table.idle_rows(np.array([[4, 1], [2, 3]])).tolist() == [[0, 1], [0, 1]]
    assert table.hits_rows(np.array([[3, 4], [2, 3]])).tolist() == [[1, 0], [2, 0]]


def test_restore_sets_hits_and_idle_of_the_first_positions():
    table = HitTable(batch=1, capacity=6)
    for _ in range(10):
        table.record(np.array([[5]]))
    table.restore(np.array([3, 0, 7]), np.array([0, 4, 250]))
    assert table.hits[0, :3].tolist() == [3, 0, 7]
    assert table.idle(0, np.arange(3)).tolist() == [0, 4, OLDEST]  # clamped: the count must not wrap later


def test_any_idle_equals_the_idle_counts_of_a_pools_used_slots():
    """Positions as a pool keeps them (its used columns of a wider array); stamps that wrapped past 255 steps."""
    rng = np.random.default_rng(0)
    table = HitTable(batch=3, capacity=400, decay_every=10_000)
    pool = np.stack([rng.permutation(400) for _ in range(3)])
    for step in range(300):
        table.record(np.stack([rng.choice(400, 40, replace=False) for _ in range(3)]) if step % 7 else pool[:, :350])
    used = pool[:, :300]
    for steps in (1, 5, 16, 40, 255):
        expected = (table.idle_rows(used) >= steps).any(axis=1)
        assert table.any_idle(used, steps).tolist() == expected.tolist()
    assert table.any_idle(pool[:, :0], 1).tolist() == [False] * 3


def test_any_hit_equals_the_hits_of_each_rows_tail():
    """Positions as the top-alpha gives them (each row's cold ones from its own column on), rows of a wider array."""
    rng = np.random.default_rng(1)
    table = HitTable(batch=4, capacity=300)
    table.hits[:] = rng.integers(0, 8, size=(4, 300))
    chosen = np.stack([rng.permutation(300) for _ in range(4)])[:, :50]
    for first in (np.array([0, 10, 49, 50]), np.array([50] * 4), np.zeros(4, dtype=np.int64)):
        for hits in (0, 1, 4, 7, 8, 300):
            expected = [(table.hits[row, chosen[row, first[row]:]] >= hits).any() for row in range(4)]
            assert table.any_hit(chosen, first, hits).tolist() == expected


def test_any_hit_refuses_a_first_column_outside_the_row():
    table = HitTable(batch=2, capacity=10)
    for first in ([0, 3], [-1, 0]):
        with pytest.raises(ValueError, match="first column lies outside the row"):
            table.any_hit(np.array([[1, 2], [3, 4]]), np.array(first), 1)


def test_positions_outside_the_table_are_refused_and_nothing_is_written():
    table = HitTable(batch=2, capacity=10)
    before = table.hits.copy(), table.stamp.copy(), table.steps
    for positions in (np.array([[1, 2], [3, 10]]), np.array([[1, -1], [3, 4]])):
        with pytest.raises(ValueError, match="outside the table"):
            table.record(positions)
        with pytest.raises(ValueError, match="outside the table"):
            table.any_idle(positions, 1)
        with pytest.raises(ValueError, match="outside the table"):
            table.any_hit(positions, np.zeros(2, dtype=np.int64), 1)
    assert np.array_equal(table.hits, before[0]) and np.array_equal(table.stamp, before[1])
    assert table.steps == before[2]
