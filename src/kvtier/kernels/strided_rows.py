"""A 2-D int64 array's rows as the compiled kernels take them (top_share.c, hit_table.c): one flat buffer from its
first row on, and the row stride. A pool's used columns (`positions[:, :used]`) go in place, without a copy."""

from __future__ import annotations

import numpy as np


def strided_rows(rows: np.ndarray) -> tuple[np.ndarray, int]:
    """`rows` [count, n] as a flat int64 buffer in which row r starts at element r x stride, and that stride."""
    count, n = rows.shape
    item = np.dtype(np.int64).itemsize
    if (rows.dtype != np.int64 or (n > 1 and rows.strides[1] != item)
            or (count > 1 and (rows.strides[0] < n * item or rows.strides[0] % item))):
        rows = np.ascontiguousarray(rows, dtype=np.int64)
    stride = rows.strides[0] // item if count > 1 else n
    flat = np.lib.stride_tricks.as_strided(rows, ((count - 1) * stride + n if count else 0,), (item,))
    return flat, stride
