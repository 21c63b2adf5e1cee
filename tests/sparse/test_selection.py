"""Exact attention over the device window and the chosen tokens: one softmax over segments equals the softmax over
all their tokens, and attention over the chosen hot and cold tokens equals dense attention over exactly them."""

import math

import numpy as np
import pytest
import torch

from kvtier.kernels import ops
from kvtier.sparse import selection
from kvtier.sparse.hot.hot_pool import importance
from kvtier.sparse.selection import (MIN_CANDIDATES, Picks, Segment, candidate_counts, candidate_scores,
                                     candidates_in_place, chosen_copied, chosen_in_place, exact_attention, shortlist,
                                     window_segment)

B, HKV, G, D = 2, 2, 3, 8


def _dense_attention(query, keys, values, scaling):
    """Reference: softmax over every token, per query head (GQA: head h uses KV head h // G)."""
    keys, values = keys.repeat_interleave(G, dim=1), values.repeat_interleave(G, dim=1)
    weights = (torch.matmul(query, keys.transpose(2, 3)) * scaling).softmax(-1)
    return torch.matmul(weights, values).transpose(1, 2)  # [B, 1, Hq, D]


def _segment(query, keys, values, first):
    grouped = query[:, :, 0].reshape(B, HKV, G, D)
    positions = np.broadcast_to(np.arange(first, first + keys.shape[2]), (B, keys.shape[2]))
    return Segment(torch.matmul(grouped, keys.transpose(2, 3)), values, positions)


@pytest.fixture(params=["torch", pytest.param("compiled", marks=pytest.mark.skipif(
    not ops.VECTORIZED, reason="needs AVX2 and FMA"))])
def attention_path(request, monkeypatch):
    """exact_attention through torch's ops, or the compiled call (chosen_values.attend) where it reads every segment."""
    if request.param == "torch":
        monkeypatch.setattr(selection, "compiled_sources", lambda segments: None)
    else:
        monkeypatch.setattr(selection, "_attended", _counted(selection._attended))
    yield request.param
    if request.param == "compiled":
        assert selection._attended.calls, "the compiled call never ran"


def _counted(function):
    def counted(*args, **kwargs):
        counted.calls += 1
        return function(*args, **kwargs)

    counted.calls = 0
    return counted


def test_attention_over_segments_equals_the_softmax_over_all_their_tokens(attention_path):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(B, HKV * G, 1, D, generator=gen)
    keys, values = torch.randn(B, HKV, 30, D, generator=gen), torch.randn(B, HKV, 30, D, generator=gen)
    scaling = D ** -0.5
    parts = [_segment(query, keys[:, :, a:b], values[:, :, a:b], a) for a, b in ((0, 7), (7, 7), (7, 19), (19, 30))]
    torch.testing.assert_close(exact_attention(parts, query, scaling), _dense_attention(query, keys, values, scaling))


def test_a_boolean_mask_drops_its_tokens_exactly():
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(B, HKV * G, 1, D, generator=gen)
    keys, values = torch.randn(B, HKV, 12, D, generator=gen), torch.randn(B, HKV, 12, D, generator=gen)
    mask = torch.ones(B, 1, 1, 12, dtype=torch.bool)
    mask[:, :, :, 5] = False
    masked = exact_attention([_segment(query, keys, values, 0)], query, 0.3, attention_mask=mask)
    keep = [i for i in range(12) if i != 5]
    torch.testing.assert_close(masked, _dense_attention(query, keys[:, :, keep], values[:, :, keep], 0.3))


def test_picks_take_the_top_alpha_share_and_split_hot_from_cold():
    hot = torch.tensor([[5.0, 1.0, 9.0, 0.0], [0.0, 0.0, 0.0, 8.0]])
    cold = torch.tensor([[7.0, 2.0, 3.0], [6.0, 9.0, 1.0]])
    hot_positions = np.array([[10, 11, 12, 13, 0, 0], [20, 21, 22, 23, 0, 0]])[:, :4]  # a pool's used slots
    cold_positions = np.array([[50, 51, 52], [60, 61, 62]])
    picks = Picks.top(hot, cold, hot_positions, cold_positions, alpha=3 / 7)
    assert picks.chosen.tolist() == [[0, 2, 4], [3, 4, 5]]  # each row's hot tokens first
    assert picks.hot_counts.tolist() == [2, 1] and picks.cold_counts.tolist() == [1, 2]
    assert picks.hot_slots().tolist() == [[0, 2], [3, 0]]  # padded with slot 0
    assert [picks.cold_rows(seq).tolist() for seq in range(2)] == [[0], [0, 1]]
    assert picks.positions.tolist() == [[10, 12, 50], [23, 60, 61]]
    assert [list(p) for p in picks.cold_positions] == [[50], [60, 61]]
    assert picks.cold_chosen.tolist() == [[True, False, False], [True, True, False]]
    assert picks.hot_count + picks.cold_count == 2 * math.ceil(3 / 7 * 7)


def test_candidate_counts_are_the_margin_times_the_picks_within_the_pool():
    counts = candidate_counts(1.5, np.array([0, 20, 40, 300]), cold_tokens=100, least=0)
    assert counts.tolist() == [MIN_CANDIDATES, 30, 60, 100]
    assert candidate_counts(1.5, np.array([0, 40]), cold_tokens=100, least=70).tolist() == [70, 70]


def test_the_shortlist_is_the_best_sketch_scores_margin_times_the_cold_picks():
    """30 hot and 40 cold tokens, top-20: row 0's hot scores lose to every cold one, so the top-20 takes 20 cold
    tokens and the shortlist is the 30 best cold; row 1's hot scores win, no cold token is taken, and the shortlist
    is the MIN_CANDIDATES best."""
    cold = np.stack([np.random.default_rng(seed).permutation(40).astype(np.float32) for seed in (0, 1)])
    hot = np.array([[-1.0] * 30, [100.0] * 30], dtype=np.float32)
    slots = shortlist(hot, cold, alpha=20 / 70, margin=1.5, least=0)
    assert slots[0].tolist() == np.flatnonzero(cold[0] >= 10).tolist()
    assert slots[1].tolist() == np.flatnonzero(cold[1] >= 40 - MIN_CANDIDATES).tolist()
    assert [len(row) for row in shortlist(hot, cold, alpha=20 / 70, margin=1.5, least=35)] == [35, 35]


def _candidate_records(gen, own, stale):
    """Candidates' K/V [B, HKV, own + stale, D] as their reads land: views of token records [B, tokens, 2, HKV, D]
    (every head of a token in one record), the last `stale` rows of each sequence left from an earlier answer."""
    records = torch.randn(B, own + stale, 2, HKV, D, generator=gen)
    records[:, own:] = 1e4
    return records[:, :, 0].transpose(1, 2), records[:, :, 1].transpose(1, 2)


@pytest.mark.parametrize("compiled", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(not ops.VECTORIZED, reason="needs AVX2 and FMA")),
])
def test_the_candidates_padding_is_never_among_the_top_and_weighs_nothing(compiled, monkeypatch):
    """Torch's ops (where the kernel does not run) and the compiled pass agree."""
    if not compiled:
        monkeypatch.setattr(selection, "compiled_rows", lambda rows: False)
    gen = torch.Generator().manual_seed(0)
    grouped = torch.randn(B, HKV, G, D, generator=gen)
    keys, _ = _candidate_records(gen, own=6, stale=3)
    counts = np.array([6, 4])
    dots, scores = candidate_scores(grouped, keys, counts, "sum")
    expected = torch.matmul(grouped, keys.transpose(2, 3))
    for seq, count in enumerate(counts):
        torch.testing.assert_close(dots[seq, ..., :count], expected[seq, ..., :count])
        torch.testing.assert_close(scores[seq, :count], importance(expected, "sum")[seq, :count])
        assert torch.isneginf(dots[seq, ..., count:]).all() and torch.isneginf(scores[seq, count:]).all()


@pytest.mark.parametrize("seed, hot_picks, cold_picks", [(2, [[1, 4, 7, 19], [0, 2]], [[3], [0, 5, 8]]),
                                                        (3, [[1, 4, 7, 19], [0, 2]], [[3], [0, 5, 8]]),
                                                        (4, [[1, 4, 7], [0, 2, 11]], [[3, 4], [0, 8]]),
                                                        (5, [[], [0, 2, 11]], [[3, 4, 6], [0]]),
                                                        (6, [[1, 4, 7, 19], [0, 2, 5, 11]], [[], [0]])])
@pytest.mark.parametrize("in_place", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(not ops.VECTORIZED, reason="needs AVX2 and FMA")),
])
def test_attention_over_the_chosen_equals_dense_attention_over_exactly_them(seed, hot_picks, cold_picks, in_place,
                                                                           attention_path):
    """Hot and cold counts differ between the sequences (padded) or not; the chosen values copied out or read where
    they lie: in the hot pool, and among the candidates' records (the unchosen masked, the stale rows past a
    sequence's own never read)."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(B, HKV * G, 1, D, generator=gen)
    grouped = query[:, :, 0].reshape(B, HKV, G, D)
    hot_keys, hot_values = torch.randn(B, HKV, 20, D, generator=gen), torch.randn(B, HKV, 20, D, generator=gen)
    cold_keys, cold_values = _candidate_records(gen, own=9, stale=2)
    window_keys, window_values = torch.randn(B, HKV, 5, D, generator=gen), torch.randn(B, HKV, 5, D, generator=gen)
    hot_picks = [np.array(slots, dtype=np.int64) for slots in hot_picks]
    cold_picks = [np.array(slots, dtype=np.int64) for slots in cold_picks]
    hot_dots = torch.matmul(grouped, hot_keys.transpose(2, 3))
    hot_slots, hot_counts = _padded(hot_picks)
    hot = (chosen_in_place if in_place else chosen_copied)(hot_dots, hot_values, hot_slots, hot_counts,
                                                           100 + hot_slots)
    counts = np.array([9, 9])
    cold_dots, _ = candidate_scores(grouped, cold_keys, counts, "sum")
    unchosen = torch.ones(B, 11, dtype=torch.bool)
    for seq, rows in enumerate(cold_picks):
        unchosen[seq, rows] = False
    cold_dots.masked_fill_(unchosen[:, None, None, :], float("-inf"))
    cold_positions = np.arange(200, 211)[None].repeat(B, 0)
    cold = (candidates_in_place(cold_dots, cold_values, cold_positions, counts) if in_place
            else Segment(cold_dots, cold_values, cold_positions))
    window = window_segment(grouped, window_keys, window_values, np.arange(5))
    output = exact_attention([window, hot, cold], query, 0.4)
    for seq in range(B):
        keys = torch.cat([window_keys[seq], hot_keys[seq][:, hot_picks[seq]], cold_keys[seq][:, cold_picks[seq]]], 1)
        values = torch.cat([window_values[seq], hot_values[seq][:, hot_picks[seq]],
                            cold_values[seq][:, cold_picks[seq]]], 1)
        expected = _dense_attention(query[seq : seq + 1], keys[None], values[None], 0.4)
        torch.testing.assert_close(output[seq : seq + 1], expected)


def _padded(chosen):
    """Per-sequence slot lists as the selection passes them: [B, most chosen] (padded with slot 0) and the counts."""
    slots = np.zeros((len(chosen), max(len(row) for row in chosen)), dtype=np.int64)
    for seq, row in enumerate(chosen):
        slots[seq, : len(row)] = row
    return slots, np.array([len(row) for row in chosen], dtype=np.int64)


def test_a_segment_left_in_the_pool_stays_on_the_host():
    slots, counts = _padded([np.array([1]), np.array([0, 2])])
    segment = chosen_in_place(torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 4, 8), slots, counts, slots)
    assert segment.to(torch.device("cpu")) is segment
    with pytest.raises(ValueError, match="host memory"):
        segment.to(torch.device("meta"))
