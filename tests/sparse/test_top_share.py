"""Each row's top scores in index order: the same choice as a stable sort by descending score, ties to the lowest
index, NaN lowest."""

import numpy as np
import pytest

from kvtier.sparse.top_share import top_share


@pytest.mark.parametrize("kind", ["distinct", "ties", "infinite", "nan"])
def test_top_share_takes_the_largest_in_index_order_and_ties_to_the_lowest_index(kind):
    rng = np.random.default_rng(len(kind))
    for _ in range(200):
        rows, n = int(rng.integers(1, 9)), int(rng.integers(1, 200))
        count = int(rng.integers(1, n + 1))
        scores = rng.standard_normal((rows, n)).astype(np.float32) if kind in ("distinct", "infinite") \
            else rng.integers(0, 4, size=(rows, n)).astype(np.float32)
        if kind in ("infinite", "nan"):
            scores[rng.random((rows, n)) < 0.3] = -np.inf if kind == "infinite" else np.nan
        ranked = np.where(np.isnan(scores), -np.inf, scores)  # NaN ranks lowest
        chosen = top_share(scores, count)
        for row in range(rows):  # a stable sort by descending score, then back into index order
            expected = np.sort(np.lexsort((np.arange(n), -ranked[row].astype(np.float64)))[:count])
            assert chosen[row].tolist() == expected.tolist()


def test_top_share_of_nothing_and_bad_shapes():
    assert top_share(np.zeros((3, 5), dtype=np.float32), 0).shape == (3, 0)
    with pytest.raises(ValueError, match="count"):
        top_share(np.zeros((3, 5), dtype=np.float32), 6)
