"""Each row's top scores as ascending indices: the host's top-alpha (selection.py) and the scorer's candidates
(candidate_reads.py). Compiled (top_share.c): numpy's argpartition and the sort of its result back into index order
cost three times as much (docs/decisions.md). Imports no torch: the scorer process uses it."""

from __future__ import annotations

import numpy as np

from kvtier.sparse import _top_share


def top_share(scores: np.ndarray, count: int) -> np.ndarray:
    """Indices [rows, count] of each row's `count` largest scores ([rows, n]), ascending; among equal scores the
    lowest indices, NaN ranked lowest. Raises ValueError when count > n."""
    chosen = np.empty((len(scores), count), dtype=np.int64)
    if count:
        _top_share.top_share(np.ascontiguousarray(scores, dtype=np.float32), chosen, len(scores), scores.shape[1],
                             count)
    return chosen
