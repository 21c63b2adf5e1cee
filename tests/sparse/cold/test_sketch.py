import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.sparse.cold.sketch import SketchFormat, quantize, score


def _keys(tokens=500, heads=3, head_dim=64, seed=0):
    return np.random.default_rng(seed).standard_normal((tokens, heads, head_dim)).astype(np.float32)


def _decoded(records: np.ndarray, fmt: SketchFormat) -> np.ndarray:
    """Reference decoder (float64 [tokens, heads, head_dim]), straight from the layout in sketch.py's docstring."""
    scales = records[:, : 2 * fmt.groups].copy().view(np.float16).astype(np.float64)
    raw = records[:, 2 * fmt.groups :]
    if fmt.bits == 8:
        codes = raw.view(np.int8).astype(np.float64)
    else:
        nibbles = np.stack([raw & 0x0F, raw >> 4], axis=2).reshape(len(records), -1).astype(np.int64)
        codes = np.where(nibbles > 7, nibbles - 16, nibbles).astype(np.float64)
    values = codes.reshape(len(records), fmt.groups, fmt.group) * scales[:, :, None]
    return values.reshape(len(records), fmt.heads, fmt.head_dim)


@pytest.mark.parametrize("bits, record_bytes, max_error", [(8, 3 * 64 + 2 * 6, 0.03), (4, 3 * 32 + 2 * 6, 0.5)])
def test_round_trip_error_is_bounded_by_half_a_step(bits, record_bytes, max_error):
    fmt = SketchFormat(bits, 3, 64)
    keys = _keys()
    records = quantize(keys, fmt)
    assert records.shape == (500, record_bytes) and fmt.record_bytes == record_bytes
    error = np.abs(_decoded(records, fmt) - keys)
    step = np.abs(keys).reshape(500, 6, 32).max(axis=2) / (127 if bits == 8 else 7)
    assert (error.reshape(500, 6, 32) <= step[:, :, None] * 0.5 + 1e-3).all()
    assert error.max() < max_error


# groups of 32 and 16 take the vector path where the CPU has one; groups of 4 and 40 queries per head the portable one
FORMATS = [SketchFormat(8, 3, 64), SketchFormat(4, 3, 64), SketchFormat(8, 2, 48, group=16),
           SketchFormat(8, 2, 12, group=4), SketchFormat(4, 2, 12, group=4)]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_sum_score_is_the_summed_query_dot_decoded_keys(fmt):
    records = quantize(_keys(300, fmt.heads, fmt.head_dim), fmt)
    query = np.random.default_rng(1).standard_normal((fmt.heads, 1, fmt.head_dim)).astype(np.float32)
    expected = np.einsum("thd,hd->t", _decoded(records, fmt), query[:, 0])
    np.testing.assert_allclose(score(records, query, fmt, "sum"), expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("per_head", [1, 3, 40])
def test_max_score_takes_the_best_query_head(fmt, per_head):
    records = quantize(_keys(200, fmt.heads, fmt.head_dim), fmt)
    query = np.random.default_rng(2).standard_normal((fmt.heads, per_head, fmt.head_dim)).astype(np.float32)
    per_query = np.einsum("thd,hqd->thq", _decoded(records, fmt), query).reshape(200, -1)
    np.testing.assert_allclose(score(records, query, fmt, "max"), per_query.max(axis=1), rtol=1e-4, atol=1e-3)


def test_tiny_keys_keep_their_subnormal_scales():
    fmt = SketchFormat(8, 1, 32, group=32)
    keys = _keys(50, 1, 32) * 1e-6  # scales ~1e-8: below float16's smallest normal number
    records = quantize(keys, fmt)
    query = np.ones((1, 1, 32), np.float32)
    expected = np.einsum("thd,hd->t", _decoded(records, fmt), query[:, 0])
    assert np.abs(expected).max() > 0
    np.testing.assert_allclose(score(records, query, fmt, "sum"), expected, rtol=1e-4, atol=1e-12)


def test_scores_are_written_into_the_given_buffer():
    fmt = SketchFormat(8, 3, 64)
    records = quantize(_keys(100), fmt)
    query = np.random.default_rng(4).standard_normal((3, 1, 64)).astype(np.float32)
    out = np.full(128, -1.0, dtype=np.float32)
    written = score(records, query, fmt, "sum", out=out)
    assert np.shares_memory(written, out) and len(written) == 100
    np.testing.assert_array_equal(written, score(records, query, fmt, "sum"))
    assert (out[100:] == -1).all()


def test_records_and_query_must_fit_the_format():
    fmt = SketchFormat(8, 3, 64)
    records = quantize(_keys(10), fmt)
    query = np.ones((3, 1, 64), np.float32)
    with pytest.raises(ValueError, match="whole number of 204-byte records"):
        score(records.reshape(-1)[:-1], query, fmt, "sum")
    with pytest.raises(ValueError, match="does not fit 3 heads of 64 dims"):
        score(records, np.ones((2, 1, 64), np.float32), fmt, "sum")
    with pytest.raises(ValueError, match="fewer float32 values"):
        score(records, query, fmt, "sum", out=np.empty(5, np.float32))


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
