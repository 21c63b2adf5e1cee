import numpy as np
import torch

from kvtier.baselines.prompt_attention import attention_mass
from kvtier.sparse.hot.initial_placement import seed_hits, selection_importance, split_hot_cold


def test_selection_importance_averages_the_summed_dots_each_key_receives_from_the_queries_that_see_it():
    torch.manual_seed(0)
    queries, keys = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8)  # 2 query heads per KV head
    importance = selection_importance(queries, keys, "sum")
    expected, seen = torch.zeros(10), torch.zeros(10)
    for i in range(3):
        visible = 10 - 3 + i + 1
        for head in range(4):
            expected[:visible] += queries[0, head, i] @ keys[0, head // 2, :visible].T
        seen[:visible] += 1
    torch.testing.assert_close(importance[0], expected / seen)


def test_selection_importance_under_max_takes_each_query_s_best_head():
    torch.manual_seed(1)
    queries, keys = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 10, 8)
    importance = selection_importance(queries, keys, "max")
    for seq in range(2):
        expected, seen = torch.zeros(10), torch.zeros(10)
        for i in range(3):
            visible = 10 - 3 + i + 1
            dots = torch.stack([queries[seq, head, i] @ keys[seq, head // 2, :visible].T for head in range(4)])
            expected[:visible] += dots.amax(dim=0)
            seen[:visible] += 1
        torch.testing.assert_close(importance[seq], expected / seen)


def test_hot_placement_by_selection_score_holds_what_the_step_selects_where_attention_mass_would_not():
    # one key gets a large positive dot from one head and nothing from the other: by attention mass it is the most
    # important key, but the summed dots (what the decode step ranks by) put it last
    queries = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]])  # [1, 2 heads, 1 query, D=2], one KV head each
    keys = torch.tensor([[[[9.0, 0], [1.0, 0], [1.0, 0]], [[0.0, -20], [0.0, 1], [0.0, 1]]]])  # [1, 2, 3, 2]
    assert np.argsort(-attention_mass(queries, keys, scaling=1.0)[0].numpy())[0] == 0
    assert np.argsort(-selection_importance(queries, keys, "sum")[0].numpy())[-1] == 0


def test_split_keeps_the_most_important_hot_in_position_order():
    hot, cold = split_hot_cold(np.array([[0.1, 0.9, 0.3, 0.8, 0.0]]), hot_tokens=2)
    assert hot.tolist() == [[1, 3]] and cold.tolist() == [[0, 2, 4]]


def test_seed_hits_marks_the_top_alpha():
    hits = seed_hits(np.array([[0.1, 0.9, 0.3, 0.8, 0.0]]), alpha=0.4)
    assert hits.tolist() == [[0, 1, 0, 1, 0]]
