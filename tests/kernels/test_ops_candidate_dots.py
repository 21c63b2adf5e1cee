import numpy as np
import pytest
import torch
from exact_values import small_integers

from kvtier.kernels import ops
from kvtier.sparse.hot.hot_pool import importance

pytestmark = pytest.mark.skipif(not ops.VECTORIZED, reason="the kernel needs AVX2 and FMA")


def _dots(keys, query, counts, aggregation, rows=None):
    """The kernel's dots and importance over `keys` [batch, heads, width, head_dim], viewed in `rows` (their buffer)
    where given; both start as NaN, so a place the kernel leaves unwritten shows."""
    batch, heads, group, head_dim = query.shape
    out = torch.full((batch, heads, group, keys.shape[2]), float("nan"))
    token_importance = torch.full((batch, keys.shape[2]), float("nan"))
    rows = keys if rows is None else rows
    bits = rows.view(torch.int16) if rows.dtype == torch.bfloat16 else rows
    ops.candidate_dots(keys=ops.Rows(bits.numpy(), keys.storage_offset(), keys.stride()[:3], keys.shape),
                       query=query.numpy(), counts=np.array(counts, dtype=np.int64), out=out.numpy(),
                       importance=token_importance.numpy(), aggregation=aggregation)
    return out, token_importance


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [1, 3, 4, 7])
@pytest.mark.parametrize("head_dim", [8, 64, 72])
@pytest.mark.parametrize("aggregation", ["sum", "max"])
def test_the_dots_and_importance_equal_torchs_and_the_padding_is_minus_infinity(dtype, group, head_dim, aggregation):
    """Counts short of the width (padding), none, and the whole width; query heads in passes of 4 and their tails."""
    batch, heads, width = 3, 2, 21
    counts = [13, 0, width]
    keys = small_integers((batch, heads, width, head_dim), seed=head_dim).to(dtype)
    query = small_integers((batch, heads, group, head_dim), seed=group)
    dots, token_importance = _dots(keys, query, counts, aggregation)
    expected = torch.matmul(query, keys.float().transpose(2, 3))
    for seq, count in enumerate(counts):
        torch.testing.assert_close(dots[seq, ..., :count], expected[seq, ..., :count], rtol=0, atol=0)
        torch.testing.assert_close(token_importance[seq, :count], importance(expected, aggregation)[seq, :count],
                                   rtol=0, atol=0)
        assert torch.isneginf(dots[seq, ..., count:]).all() and torch.isneginf(token_importance[seq, count:]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_keys_in_token_records_are_read_where_they_lie(dtype):
    """Keys in records [batch, tokens, K|V, heads, head_dim], as the candidates' reads land; the padding rows hold
    what an earlier answer left (here NaN) and are never read."""
    batch, heads, tokens, head_dim, group = 2, 3, 30, 64, 3
    records = small_integers((batch, tokens, 2, heads, head_dim), seed=3).to(dtype)
    records[1, 9:] = float("nan")
    keys = records[:, :, 0].transpose(1, 2)  # [batch, heads, tokens, head_dim], at the records' strides
    query = small_integers((batch, heads, group, head_dim), seed=4)
    dots, token_importance = _dots(keys, query, [tokens, 9], "sum", rows=records)
    expected_dots, expected_importance = _dots(keys.contiguous(), query, [tokens, 9], "sum")
    torch.testing.assert_close(dots, expected_dots, rtol=0, atol=0)
    torch.testing.assert_close(token_importance, expected_importance, rtol=0, atol=0)


@pytest.mark.parametrize("change, message", [
    (dict(count=9), "exceeds the width"),
    (dict(count=-1), "exceeds the width"),
    (dict(head_dim=12), "multiple of 8"),
    (dict(aggregation="mean"), "^aggregation: 'mean'"),
    (dict(key_dtype=np.float64), "^keys.buffer: float64 .*need C-contiguous float32 or int16"),
    (dict(out_rows=1), "^out: shape .* does not match"),
    (dict(first=1), "within their buffer"),
    (dict(first=-1), "within their buffer"),
    (dict(query_heads=2), "^keys: shape .* does not match query's"),
    (dict(counts_dtype=np.int32), "^counts: int32"),
    (dict(counts_length=3), "^counts: shape \\(3,\\) does not match"),
    (dict(importance_width=7), "^importance: shape .* does not match"),
])
def test_bad_input_is_refused_not_read(change, message):
    batch, heads, group, width = 2, 1, 2, 8
    head_dim = change.get("head_dim", 16)
    keys = np.zeros((batch, heads, width, head_dim), dtype=change.get("key_dtype", np.float32))
    rows = ops.Rows(keys, change.get("first", 0), tuple(np.array(keys.strides[:3]) // keys.itemsize), keys.shape)
    query = np.zeros((batch, change.get("query_heads", heads), group, head_dim), dtype=np.float32)
    counts = np.array([width, change.get("count", width)] + [0] * (change.get("counts_length", 2) - 2),
                      dtype=change.get("counts_dtype", np.int64))
    out = np.zeros((batch, heads, group - change.get("out_rows", 0), width), dtype=np.float32)
    token_importance = np.zeros((batch, change.get("importance_width", width)), dtype=np.float32)
    with pytest.raises(ValueError, match=message):
        ops.candidate_dots(keys=rows, query=query, counts=counts, out=out, importance=token_importance,
                           aggregation=change.get("aggregation", "sum"))
