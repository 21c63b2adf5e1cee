import numpy as np

from kvtier.sparse.hit_table import HitTable


def test_two_bytes_per_token():
    assert HitTable(batch=3, capacity=1000).nbytes == 2 * 3 * 1000


def test_record_counts_hits_and_idle_steps_with_decay():
    table = HitTable(batch=1, capacity=8, decay_every=4)
    table.record(np.array([[1, 2]]), tokens=6)
    table.record(np.array([[2, 3]]), tokens=6)
    assert table.hits[0, :6].tolist() == [0, 1, 2, 1, 0, 0]
    assert table.idle[0, :6].tolist() == [2, 1, 0, 0, 2, 2]
    assert table.idle[0, 6:].tolist() == [0, 0]  # positions beyond the context are untouched
    table.record(np.array([[2, 3]]), tokens=6)
    table.record(np.array([[2, 3]]), tokens=6)  # 4th step: hits halve
    assert table.hits[0, :4].tolist() == [0, 0, 2, 1]


def test_counters_saturate():
    table = HitTable(batch=1, capacity=2, decay_every=10_000)
    for _ in range(300):
        table.record(np.array([[0]]), tokens=2)
    assert (table.hits[0, 0], table.idle[0, 1]) == (255, 255)


def test_seed_sets_hits_and_resets_idle():
    table = HitTable(batch=2, capacity=5)
    table.record(np.array([[0], [0]]), tokens=5)
    table.seed(np.array([[3, 4], [1, 2]]), np.array([[1, 0], [2, 2]]))
    assert table.hits.tolist() == [[1, 0, 0, 1, 0], [1, 2, 2, 0, 0]]
    assert table.idle[:, 1:].tolist() == [[1, 1, 0, 0], [0, 0, 1, 1]]
