"""The hit table's kernels through ops (their results: tests/sparse/hot/test_hit_table.py): a pool's used columns
read in place, and arguments that do not fit the table refused before the scan."""

import numpy as np
import pytest

from kvtier.kernels import ops


def _table(rows=2, capacity=10):
    return np.zeros((rows, capacity), dtype=np.uint8), np.zeros((rows, capacity), dtype=np.uint8)


def test_the_three_scans_read_positions_at_a_row_stride():
    hits, stamp = _table()
    pool = np.array([[1, 3, 5, -1, -1], [0, 2, 4, -1, -1]], dtype=np.int64)
    ops.record_hits(hits, stamp, positions=pool[:, :3], now=7)
    assert hits.nonzero()[1].tolist() == [1, 3, 5, 0, 2, 4] and (stamp[hits > 0] == 7).all()
    assert ops.any_hit(hits, positions=pool[:, :3], first=np.array([0, 3]), needed=1).tolist() == [True, False]
    assert ops.any_idle(stamp, positions=pool[:, :3], now=9, steps=2).tolist() == [True, True]
    assert ops.any_idle(stamp, positions=pool[:, :3], now=9, steps=3).tolist() == [False, False]


@pytest.mark.parametrize("call, message", [
    (lambda hits, stamp: ops.record_hits(hits, stamp[:1], positions=np.zeros((2, 1)), now=0),
     "^stamp: shape .* does not match hits'"),
    (lambda hits, stamp: ops.record_hits(hits.astype(np.int64), stamp, positions=np.zeros((2, 1)), now=0),
     "^hits: int64 .*need C-contiguous uint8"),
    (lambda hits, stamp: ops.record_hits(hits, stamp, positions=np.zeros((3, 1)), now=0),
     "^positions: shape \\(3, 1\\) does not match the table's"),
    (lambda hits, stamp: ops.record_hits(hits, stamp, positions=np.zeros((2, 1)), now=256), "^now: 256"),
    (lambda hits, stamp: ops.any_idle(stamp, positions=np.zeros(2), now=0, steps=1), "^positions: shape \\(2,\\)"),
    (lambda hits, stamp: ops.any_idle(stamp[:, ::2], positions=np.zeros((2, 1)), now=0, steps=1),
     "^stamp: .*not C-contiguous"),
    (lambda hits, stamp: ops.any_hit(hits, positions=np.zeros((2, 1)), first=np.zeros(3, dtype=np.int64), needed=1),
     "^first: shape \\(3,\\) does not match"),
    (lambda hits, stamp: ops.any_hit(hits, positions=np.zeros((2, 1)), first=np.zeros(2, dtype=np.int32), needed=1),
     "^first: int32"),
])
def test_arguments_that_do_not_fit_the_table_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call(*_table())


def test_a_position_outside_the_table_is_refused_by_the_scan():
    hits, stamp = _table()
    with pytest.raises(ValueError, match="outside the table"):
        ops.record_hits(hits, stamp, positions=np.array([[0], [10]]), now=0)
