import numpy as np
import torch

from kvtier.sparse.placement import observation_importance, seed_hits, split_hot_cold


def test_observation_importance_is_causal_attention_mass():
    torch.manual_seed(0)
    queries, keys = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8)  # 2 query heads per KV head
    importance = observation_importance(queries, keys, scaling=0.5)
    expected = torch.zeros(10)
    for head in range(4):
        for i in range(3):
            visible = 10 - 3 + i + 1
            logits = queries[0, head, i] @ keys[0, head // 2, :visible].T * 0.5
            expected[:visible] += logits.softmax(-1)
    torch.testing.assert_close(importance[0], expected)
    assert importance.sum().item() == torch.tensor(12.0).item()  # each of 4 x 3 query rows sums to 1


def test_split_keeps_the_most_important_hot_in_position_order():
    hot, cold = split_hot_cold(np.array([[0.1, 0.9, 0.3, 0.8, 0.0]]), hot_tokens=2)
    assert hot.tolist() == [[1, 3]] and cold.tolist() == [[0, 2, 4]]


def test_seed_hits_marks_the_top_alpha():
    hits = seed_hits(np.array([[0.1, 0.9, 0.3, 0.8, 0.0]]), alpha=0.4)
    assert hits.tolist() == [[0, 1, 0, 1, 0]]
