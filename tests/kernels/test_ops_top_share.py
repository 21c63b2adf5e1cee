"""Each row's top scores in index order: the same choice as a stable sort by descending score, ties to the lowest
index, NaN lowest; over a row continued by more scores, the same as over the joined row; split back into the two."""

import numpy as np
import pytest

from kvtier.kernels import ops


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
        chosen = ops.top_share(scores, count=count)
        for row in range(rows):  # a stable sort by descending score, then back into index order
            expected = np.sort(np.lexsort((np.arange(n), -ranked[row].astype(np.float64)))[:count])
            assert chosen[row].tolist() == expected.tolist()


def test_top_share_of_nothing_and_bad_shapes():
    assert ops.top_share(np.zeros((3, 5), dtype=np.float32), count=0).shape == (3, 0)
    with pytest.raises(ValueError, match="^count: 6 of a row of 5 \\+ 0 scores$"):
        ops.top_share(np.zeros((3, 5), dtype=np.float32), count=6)
    with pytest.raises(ValueError, match="^count: "):
        ops.top_share(np.zeros((3, 5), dtype=np.float32), count=9, more=np.zeros((3, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="^count: "):
        ops.top_share(np.zeros((3, 5), dtype=np.float32), count=-1)
    with pytest.raises(ValueError, match="^more: .*does not match"):
        ops.top_share(np.zeros((3, 5), dtype=np.float32), count=2, more=np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="^scores: shape \\(5,\\), need \\[rows, n\\]$"):
        ops.top_share(np.zeros(5, dtype=np.float32), count=2)


def test_scores_of_another_dtype_or_layout_are_converted():
    """float64 scores, and a row-strided slice (the scorer's block of a longer row), rank as float32 ones."""
    scores = np.random.default_rng(1).standard_normal((3, 40))
    expected = ops.top_share(scores.astype(np.float32), count=7)
    assert np.array_equal(ops.top_share(scores, count=7), expected)
    wide = np.zeros((3, 50), dtype=np.float32)
    wide[:, :40] = scores
    assert np.array_equal(ops.top_share(wide[:, :40], count=7), expected)


@pytest.mark.parametrize("kind", ["distinct", "ties", "nan"])
def test_a_row_continued_by_more_scores_ranks_as_the_joined_row(kind):
    rng = np.random.default_rng(len(kind))
    for _ in range(100):
        rows, n, m = int(rng.integers(1, 9)), int(rng.integers(0, 300)), int(rng.integers(0, 300))
        if n + m == 0:
            continue
        scores = _scores(kind, rng, rows, n + m)
        count = int(rng.integers(1, n + m + 1))
        joined = ops.top_share(scores, count=count)
        assert np.array_equal(ops.top_share(scores[:, :n], count=count, more=scores[:, n:]), joined)


def test_the_split_gives_each_part_its_positions_count_and_chosen():
    """The first part's positions at a row stride (a pool's used slots), the second's contiguous."""
    rng = np.random.default_rng(0)
    rows, n, m, count = 4, 50, 30, 35
    pool = rng.integers(0, 10**6, size=(rows, n + 14))
    first, more = pool[:, :n], rng.integers(0, 10**6, size=(rows, m))
    scores = rng.standard_normal((rows, n + m)).astype(np.float32)
    chosen = ops.top_share(scores[:, :n], count=count, more=scores[:, n:])
    counts, indices, positions, more_chosen = ops.split_chosen(chosen, positions=first, more_positions=more)
    joined = np.concatenate([first, more], axis=1)
    for row in range(rows):
        assert positions[row].tolist() == joined[row, chosen[row]].tolist()
        assert counts[row] == (chosen[row] < n).sum()
        assert indices[row].tolist() == chosen[row][chosen[row] < n].tolist() + [0] * (count - counts[row])
        assert np.flatnonzero(more_chosen[row]).tolist() == (chosen[row][chosen[row] >= n] - n).tolist()
    assert more_chosen.dtype == bool


@pytest.mark.parametrize("chosen, message", [
    (np.array([[0, 2, 1]]), "ascend"),
    (np.array([[0, 1, 9]]), "below n1 \\+ n2"),
    (np.array([[-1, 1, 2]]), "below n1 \\+ n2"),
])
def test_a_split_of_indices_that_are_no_choice_is_refused(chosen, message):
    with pytest.raises(ValueError, match=message):
        ops.split_chosen(chosen, positions=np.arange(5)[None], more_positions=np.arange(3)[None])


@pytest.mark.parametrize("positions, more_positions, message", [
    (np.arange(10).reshape(2, 5), np.arange(3)[None], "^positions, more_positions: 2 and 1 rows do not match"),
    (np.arange(5)[None], np.arange(6).reshape(2, 3), "^positions, more_positions: 1 and 2 rows do not match"),
    (np.arange(5), np.arange(3)[None], "^chosen, positions, more_positions: shapes"),
])
def test_a_split_over_positions_of_other_rows_is_refused(positions, more_positions, message):
    with pytest.raises(ValueError, match=message):
        ops.split_chosen(np.array([[0, 1, 2]]), positions=positions, more_positions=more_positions)
