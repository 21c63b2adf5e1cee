import numpy as np
import pytest
import torch
from exact_values import small_integers

from kvtier.kernels import _candidate_dots
from kvtier.sparse.hot.hot_pool import importance

pytestmark = pytest.mark.skipif(not _candidate_dots.vectorized, reason="the kernel needs AVX2 and FMA")


def _dots(keys, query, counts, aggregation, rows=None):
    """The kernel's dots and importance over `keys` [batch, heads, width, head_dim], viewed in `rows` (their buffer)
    where given; both start as NaN, so a place the kernel leaves unwritten shows."""
    batch, heads, group, head_dim = query.shape
    out = torch.full((batch, heads, group, keys.shape[2]), float("nan"))
    token_importance = torch.full((batch, keys.shape[2]), float("nan"))
    rows = keys if rows is None else rows
    bits = rows.view(torch.int16) if rows.dtype == torch.bfloat16 else rows
    _candidate_dots.dots(bits.numpy(), keys.storage_offset(), *keys.stride()[:3], query.numpy(),
                         np.array(counts, dtype=np.int64), out.numpy(), token_importance.numpy(), keys.element_size(),
                         batch, heads, group, keys.shape[2], head_dim, int(aggregation == "max"))
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
    (dict(aggregation=2), "aggregation"),
    (dict(key_bytes=8), "bfloat16"),
    (dict(out_rows=1), "does not match"),
    (dict(first=1), "within their buffer"),
    (dict(first=-1), "within their buffer"),
])
def test_bad_input_is_refused_not_read(change, message):
    batch, heads, group, width = 2, 1, 2, 8
    head_dim = change.get("head_dim", 16)
    keys = torch.zeros(batch, heads, width, head_dim)
    query = torch.zeros(batch, heads, group, head_dim)
    counts = np.array([width, change.get("count", width)], dtype=np.int64)
    out = torch.zeros(batch, heads, group - change.get("out_rows", 0), width)
    token_importance = torch.zeros(batch, width)
    with pytest.raises(ValueError, match=message):
        _candidate_dots.dots(keys.numpy(), change.get("first", 0), *keys.stride()[:3], query.numpy(), counts,
                             out.numpy(), token_importance.numpy(), change.get("key_bytes", 4), batch, heads, group,
                             width, head_dim, change.get("aggregation", 0))
