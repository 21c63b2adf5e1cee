import numpy as np
import pytest
import torch

from kvtier.eval.accuracy.recall import edge_mass, estimate, exact_mass, recall_at, shortlisted


def test_exact_mass_is_one_per_query_head():
    query, keys = torch.randn(4, 8), torch.randn(2, 10, 8)
    assert exact_mass(query, keys, 8**-0.5).sum() == pytest.approx(4.0, rel=1e-5)


def test_a_planted_key_is_found_by_every_estimate():
    keys = torch.randn(2, 50, 16) * 0.1
    query = torch.randn(2, 16).repeat_interleave(2, dim=0)  # both query heads of a group alike
    keys[:, 17] = query[::2] * 2  # aligned with its group's queries
    mass = exact_mass(query, keys, 16**-0.5)
    for aggregation in ("sum", "max"):
        for bits in (None, 8, 4):
            assert int(np.argmax(estimate(query, keys, aggregation, bits))) == 17 == int(np.argmax(mass))


def test_recall_counts_overlap_and_mass():
    mass = np.array([0.5, 0.3, 0.1, 0.1])
    assert recall_at(mass, np.array([4.0, 3.0, 2.0, 1.0]), 2) == (1.0, 1.0)
    recall, mass_recall = recall_at(mass, np.array([4.0, 0.0, 3.0, 0.0]), 2)
    assert recall == 0.5 and mass_recall == pytest.approx(0.6 / 0.8)


def test_edge_mass_shares_of_first_and_last_tokens():
    mass = np.array([4.0, 1.0, 1.0, 1.0, 3.0])
    assert edge_mass(mass, 1, 0) == pytest.approx(0.4)
    assert edge_mass(mass, 0, 1) == pytest.approx(0.3)
    assert edge_mass(mass, 1, 1) == pytest.approx(0.7)
    assert edge_mass(mass, 4, 4) == pytest.approx(1.0)  # windows never count a token twice


def test_a_shortlist_keeps_the_exact_scores_of_the_tokens_the_estimate_ranks_best():
    """The estimate's best ceil(1.5 x 2) = 3 tokens keep their exact scores, so the top-2 is the exact top-2 among
    them (tokens 2 and 1), not the estimate's (0 and 1) nor the exact one overall (5 and 4)."""
    importance = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    exact = np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    chosen = shortlisted(importance, exact, k=2, margin=1.5)
    assert chosen.tolist() == [0.0, 1.0, 2.0, -np.inf, -np.inf, -np.inf]
    mass = np.array([0.0, 0.1, 0.2, 0.0, 0.0, 0.7])
    assert recall_at(mass, chosen, 2) == (0.5, pytest.approx(0.3 / 0.9))
