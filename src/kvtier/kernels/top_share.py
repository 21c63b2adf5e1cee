"""Each row's top scores as ascending indices: the host's top-alpha (selection.py) and the scorer's candidates
(candidate_reads.py). Compiled (top_share.c): numpy's argpartition and the sort of its result back into index order
cost three times as much (docs/decisions.md). Imports no torch: the scorer process uses it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.kernels import _top_share
from kvtier.kernels.strided_rows import strided_rows

NOTHING = np.empty((0, 0), dtype=np.float32)


def top_share(scores: np.ndarray, count: int, more: np.ndarray = NOTHING) -> np.ndarray:
    """Indices [rows, count] of each row's `count` largest scores ([rows, n]; continued by `more`'s row [rows, m], its
    scores at indices n..), ascending; among equal scores the lowest indices, NaN ranked lowest. Raises ValueError
    when count > n + m."""
    chosen = np.empty((len(scores), count), dtype=np.int64)
    if count:
        _top_share.top_share(np.ascontiguousarray(scores, dtype=np.float32),
                             np.ascontiguousarray(more, dtype=np.float32), chosen, len(scores), scores.shape[1],
                             more.shape[1], count)
    return chosen


@dataclass
class Split:
    """`top_share(scores, count, more)`'s choice per row: how many of its indices lie in `scores` (they come first),
    those indices again padded with 0, the positions of the chosen tokens, and which of `more`'s were chosen."""

    counts: np.ndarray  # int64 [rows]
    indices: np.ndarray  # int64 [rows, count]: the first counts[row] of a row are its own, the rest 0
    positions: np.ndarray  # int64 [rows, count]
    more_chosen: np.ndarray  # bool [rows, m]


def split(chosen: np.ndarray, positions: np.ndarray, more_positions: np.ndarray) -> Split:
    """`chosen` (top_share's, over a row of n scores then m more) split at n: `positions` [rows, n] the positions of
    the rows' n scores (rows at any stride), `more_positions` [rows, m] those of the more."""
    rows, count = chosen.shape
    n, m = positions.shape[1], more_positions.shape[1]
    first_rows, stride = strided_rows(positions)
    out, indices = np.empty((rows, count), dtype=np.int64), np.empty((rows, count), dtype=np.int64)
    counts, more_chosen = np.empty(rows, dtype=np.int64), np.empty((rows, m), dtype=np.uint8)
    _top_share.split(np.ascontiguousarray(chosen, dtype=np.int64), first_rows,
                     np.ascontiguousarray(more_positions, dtype=np.int64), out, indices, counts, more_chosen, rows,
                     count, n, m, stride)
    return Split(counts, indices, out, more_chosen.view(bool))
