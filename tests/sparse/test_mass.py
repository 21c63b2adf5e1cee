"""The attention-mass estimate and the top-p budget: exact where every logit is known, the smallest set reaching P,
the floor, the ceiling and the guard."""

import itertools

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from kvtier.sparse.mass import TopP, estimate, sketch_mass

OPEN = TopP(p=0.9, floor=0.0, ceiling=1.0, guard=0.0)  # no clamp, no guard: the bare top-p count


def _dense_mass(logits: torch.Tensor, scaling: float) -> torch.Tensor:
    """Each token's softmax mass over every token, the mean over query heads [B, n]."""
    return torch.softmax(logits * scaling, dim=3).mean(dim=(1, 2))


def test_the_estimate_is_the_exact_mass_where_every_logit_is_known():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 2, 50, generator=gen) * 4
    window, hot, candidates = logits[..., :10], logits[..., 10:30], logits[..., 30:].clone()
    candidates[1, ..., -5:] = float("-inf")  # the second sequence's padding
    dense = _dense_mass(torch.cat([window, hot, candidates], dim=3), 0.5).numpy()
    (in_window, in_hot, read), _ = estimate([window, hot, candidates], None, 0.5, None, "sum")
    np.testing.assert_allclose(in_window, dense[:, :10], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(in_hot, dense[:, 10:30], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(read, dense[:, 30:], rtol=1e-5, atol=1e-7)
    assert read[1, -5:].tolist() == [0.0] * 5


def test_unread_tokens_are_exact_when_their_heads_agree():
    """A sketch score is a token's logits summed over the query heads: where every head gives the token the same
    logit, its mean logit is that logit, and the estimate (its own mass and its share of Z) is exact."""
    gen = torch.Generator().manual_seed(4)
    exact = torch.randn(1, 2, 3, 20, generator=gen) * 3
    agreeing = torch.randn(1, 1, 1, 15, generator=gen).mul(3).expand(1, 2, 3, 15)
    sketch = agreeing.sum(dim=(1, 2)).numpy()  # importance: summed over the 6 query heads
    dense = _dense_mass(torch.cat([exact, agreeing], dim=3), 0.7).numpy()
    (known,), log_z = estimate([exact], sketch, 0.7, None, "sum")
    np.testing.assert_allclose(known, dense[:, :20], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(sketch_mass(sketch, log_z, 0.7, None, "sum"), dense[:, 20:], rtol=1e-5, atol=1e-7)


def test_a_softcap_applies_to_the_estimate_as_to_the_attention():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 2, 2, 30, generator=gen) * 20
    capped = torch.tanh(logits * 0.5 / 5.0) * 5.0
    (masses,), _ = estimate([logits], None, 0.5, 5.0, "sum")
    np.testing.assert_allclose(masses, _dense_mass(capped, 1.0).numpy(), rtol=1e-5)


@settings(max_examples=300, deadline=None)
@given(masses=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=9), window=st.floats(0.0, 0.5),
       p=st.floats(0.05, 1.0))
def test_top_p_keeps_the_smallest_set_reaching_p(masses, window, p):
    """Masses normalized with the window's to a whole under 1 (as the unread tokens leave some); the count is the size
    of the smallest subset of tokens whose mass, with the window's, reaches P (every token where none does)."""
    row = np.array(masses)
    row = row / max(row.sum() + window, 1.0) * (1 - 1e-6)
    budget = TopP(p=p, floor=0.0, ceiling=1.0, guard=0.0)
    counts, guarded = budget.counts(np.array([window]), row[None], pooled=len(row))
    reaching = [size for size in range(len(row) + 1)
                for subset in itertools.combinations(row, size) if window + sum(subset) >= p]
    assert counts[0] == max(1, min(reaching, default=len(row)))
    assert not guarded[0]


def test_top_p_counts_differ_per_sequence_and_ignore_padding():
    masses = np.array([[0.5, 0.3, 0.1, 0.05], [0.2, 0.2, 0.2, -np.inf]])
    counts, _ = OPEN.counts(np.array([0.05, 0.1]), masses, pooled=4)
    assert counts.tolist() == [3, 3]  # 0.05 + 0.5 + 0.3 + 0.1 = 0.95; 0.1 + 3 x 0.2 = 0.7: all it has
    counts, _ = TopP(p=0.5, floor=0.0, ceiling=1.0, guard=0.0).counts(np.array([0.05, 0.1]), masses, pooled=4)
    assert counts.tolist() == [1, 2]


def test_the_floor_and_the_ceiling_clamp_the_count():
    sharp = np.array([[0.89] + [0.001] * 99])
    budget = TopP(p=0.9, floor=0.05, ceiling=0.3, guard=0.5)
    assert budget.counts(np.array([0.05]), sharp, pooled=100)[0].tolist() == [5]  # one token reaches P; floor 5
    spread = np.full((1, 100), 0.0085)  # 0.1 + 0.85: P needs 94 tokens, the ceiling allows 30 (mass 0.355)
    counts, guarded = TopP(p=0.9, floor=0.05, ceiling=0.3, guard=0.3).counts(np.array([0.1]), spread, pooled=100)
    assert counts.tolist() == [30] and not guarded[0]  # 0.355 is above this guard's floor


def test_the_guard_lifts_the_ceiling_where_scores_are_flat():
    """Flat scores: P needs most tokens, the ceiling's share keeps little mass, under the guard's floor: the step
    takes as many as reaching P needs, past the ceiling."""
    flat = np.full((2, 200), 0.9 / 200)
    window = np.array([0.05, 0.05])
    budget = TopP(p=0.9, floor=0.02, ceiling=0.3, guard=0.8)
    counts, guarded = budget.counts(window, flat, pooled=200)
    assert guarded.tolist() == [True, True]
    assert counts.tolist() == [189, 189]  # 0.05 + 189 x 0.0045 = 0.9005 >= 0.9, 188 tokens 0.896
    unguarded, _ = TopP(p=0.9, floor=0.02, ceiling=0.3, guard=0.0).counts(window, flat, pooled=200)
    assert unguarded.tolist() == [60, 60]  # the ceiling: 30% of 200
