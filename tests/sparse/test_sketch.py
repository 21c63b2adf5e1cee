import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.sparse.sketch import SketchFormat, dequantize, quantize, score


def _keys(tokens=500, heads=3, head_dim=64, seed=0):
    return np.random.default_rng(seed).standard_normal((tokens, heads, head_dim)).astype(np.float32)


@pytest.mark.parametrize("bits, record_bytes, max_error", [(8, 3 * 64 + 2 * 6, 0.03), (4, 3 * 32 + 2 * 6, 0.5)])
def test_round_trip_error_is_bounded_by_half_a_step(bits, record_bytes, max_error):
    fmt = SketchFormat(bits, 3, 64)
    keys = _keys()
    records = quantize(keys, fmt)
    assert records.shape == (500, record_bytes) and fmt.record_bytes == record_bytes
    error = np.abs(dequantize(records, fmt) - keys)
    step = np.abs(keys).reshape(500, 6, 32).max(axis=2) / (127 if bits == 8 else 7)
    assert (error.reshape(500, 6, 32) <= step[:, :, None] * 0.5 + 1e-3).all()
    assert error.max() < max_error


@pytest.mark.parametrize("bits", [8, 4])
def test_sum_score_is_the_summed_query_dot_dequantized_keys(bits):
    fmt = SketchFormat(bits, 3, 64)
    records = quantize(_keys(), fmt)
    query = np.random.default_rng(1).standard_normal((3, 1, 64)).astype(np.float32)
    expected = np.einsum("thd,hd->t", dequantize(records, fmt), query[:, 0])
    np.testing.assert_allclose(score(records, query, fmt, "sum"), expected, rtol=1e-4, atol=1e-3)


def test_max_score_takes_the_best_query_head():
    fmt = SketchFormat(8, 2, 32, group=32)
    records = quantize(_keys(200, 2, 32), fmt)
    query = np.random.default_rng(2).standard_normal((2, 3, 32)).astype(np.float32)  # 3 query heads per KV head
    per_head = np.einsum("thd,hqd->thq", dequantize(records, fmt), query).reshape(200, -1)
    np.testing.assert_allclose(score(records, query, fmt, "max"), per_head.max(axis=1), rtol=1e-4, atol=1e-3)


def test_zero_keys_get_zero_scores():
    fmt = SketchFormat(4, 1, 32, group=32)
    records = quantize(np.zeros((4, 1, 32), dtype=np.float32), fmt)
    assert (score(records, np.ones((1, 1, 32), np.float32), fmt, "sum") == 0).all()


def test_int8_ranking_matches_full_precision_closely():
    fmt = SketchFormat(8, 3, 64)
    keys = _keys(2000)
    query = np.random.default_rng(3).standard_normal((3, 1, 64)).astype(np.float32)
    exact = np.einsum("thd,hd->t", keys, query[:, 0])
    approx = score(quantize(keys, fmt), query, fmt, "sum")
    top = 200
    recall = len(set(np.argsort(-exact)[:top]) & set(np.argsort(-approx)[:top])) / top
    assert recall >= 0.95


def test_group_must_divide_head_dim():
    with pytest.raises(ConfigError, match="divide head_dim"):
        SketchFormat(8, 1, 48, group=32)
    assert SketchFormat.for_keys(8, 1, 48).group == 16
