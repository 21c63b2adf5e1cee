"""Each row's top scores in index order: the same choice as a stable sort by descending score, ties to the lowest
index, NaN lowest."""

import numpy as np
import pytest

from kvtier.sparse.top_share import top_share


def _scores(kind: str, rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    if kind in ("distinct", "infinite"):
        scores = rng.standard_normal((rows, n)).astype(np.float32)
    elif kind == "close":  # every score shares its leading bits: the selection goes down to the last digit
        scores = (1000 + rng.integers(0, 50, size=(rows, n)) * 2.0 ** -13).astype(np.float32)
    elif kind == "signed zeros":  # -0 and +0 are equal scores
        scores = rng.choice(np.array([-1.0, -0.0, 0.0, 1.0], dtype=np.float32), size=(rows, n))
    else:
        scores = rng.integers(0, 4, size=(rows, n)).astype(np.float32)
    if kind in ("infinite", "nan"):
        scores[rng.random((rows, n)) < 0.3] = -np.inf if kind == "infinite" else np.nan
    return scores


@pytest.mark.parametrize("kind", ["distinct", "ties", "close", "signed zeros", "infinite", "nan"])
@pytest.mark.parametrize("longest", [200, 5000])
def test_top_share_takes_the_largest_in_index_order_and_ties_to_the_lowest_index(kind, longest):
    rng = np.random.default_rng([len(kind), longest])
    for _ in range(200 if longest == 200 else 20):
        rows, n = int(rng.integers(1, 9)), int(rng.integers(1, longest))
        count = int(rng.integers(1, n + 1))
        scores = _scores(kind, rng, rows, n)
        ranked = np.where(np.isnan(scores), -np.inf, scores)  # NaN ranks lowest
        chosen = top_share(scores, count)
        for row in range(rows):  # a stable sort by descending score, then back into index order
            expected = np.sort(np.lexsort((np.arange(n), -ranked[row].astype(np.float64)))[:count])
            assert chosen[row].tolist() == expected.tolist()


def test_top_share_of_nothing_and_bad_shapes():
    assert top_share(np.zeros((3, 5), dtype=np.float32), 0).shape == (3, 0)
    with pytest.raises(ValueError, match="count"):
        top_share(np.zeros((3, 5), dtype=np.float32), 6)
