"""The rows top_share.c's split and hit_table.c read: a pool's used columns in place, other layouts copied."""

import numpy as np

from kvtier.kernels import ops


def test_a_pools_used_columns_go_in_place():
    pool = np.arange(40, dtype=np.int64).reshape(4, 10)
    flat, stride = ops._strided_rows(pool[:, :6])
    assert stride == 10 and np.shares_memory(flat, pool)
    assert [flat[row * stride : row * stride + 6].tolist() for row in range(4)] == pool[:, :6].tolist()


def test_other_layouts_are_copied_into_rows():
    """Another dtype, a column stride, rows that overlap (a broadcast): each gives contiguous int64 rows."""
    base = np.arange(24).reshape(4, 6)
    for rows in (base.astype(np.int32), base[:, ::2], np.broadcast_to(base[0], (3, 6))):
        flat, stride = ops._strided_rows(rows)
        assert flat.dtype == np.int64
        assert [flat[row * stride : row * stride + rows.shape[1]].tolist() for row in range(len(rows))] == rows.tolist()
    flat, stride = ops._strided_rows(np.zeros((0, 5), dtype=np.int64))
    assert len(flat) == 0
