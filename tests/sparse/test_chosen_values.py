import numpy as np
import pytest
import torch
from exact_values import small_integers

from kvtier.sparse import _chosen_values
from kvtier.sparse.selection import weighs_in_place

pytestmark = pytest.mark.skipif(not _chosen_values.vectorized, reason="the kernel needs AVX2 and FMA")


def _weighted(values, slots, counts, weights, start, rows=None):
    """The kernel's sum over `values` [batch, heads, pool, head_dim], viewed in `rows` (its buffer) where given."""
    batch, heads, group, stride = weights.shape
    out = torch.full((batch, heads, group, values.shape[3]), float("nan"))
    rows = values if rows is None else rows
    bits = rows.view(torch.int16) if rows.dtype == torch.bfloat16 else rows
    _chosen_values.weighted(bits.numpy(), values.storage_offset(), *values.stride()[:3], slots, counts, weights.numpy(),
                            out.numpy(), values.element_size(), batch, heads, group, values.shape[2], slots.shape[1],
                            stride, start, values.shape[3])
    return out


def _chosen(batch, pool, counts, seed):
    """Each sequence's `counts[b]` distinct ascending slots of the pool, padded with slot 0 to the most."""
    rng = np.random.default_rng(seed)
    slots = np.zeros((batch, max(counts)), dtype=np.int64)
    for seq, count in enumerate(counts):
        slots[seq, :count] = np.sort(rng.choice(pool, count, replace=False))
    return slots, np.array(counts, dtype=np.int64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [1, 3, 4, 7])
@pytest.mark.parametrize("head_dim", [8, 40, 64, 256])
@pytest.mark.parametrize("counts", [(70, 33), (0, 5), (32, 32)])
def test_the_weighted_sum_equals_torch_over_the_copied_rows(dtype, group, head_dim, counts):
    """Blocks of 32 rows and their tails, head_dim in whole 32-float stretches or not, a sequence with none chosen."""
    batch, heads, pool, start = 2, 3, 120, 5
    values = small_integers((batch, heads, pool, head_dim), seed=head_dim).to(dtype)
    slots, count_array = _chosen(batch, pool, counts, seed=group)
    weights = small_integers((batch, heads, group, start + slots.shape[1] + 4), seed=7)
    out = _weighted(values, slots, count_array, weights, start)
    for seq, count in enumerate(counts):
        rows = values[seq][:, torch.from_numpy(slots[seq, :count])].float()  # [heads, count, head_dim]
        expected = torch.matmul(weights[seq][..., start : start + count], rows)
        torch.testing.assert_close(out[seq], expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_at_any_strides_are_read_where_they_lie(dtype):
    """Values in token records [batch, tokens, K|V, heads, head_dim], as the candidates' reads land: the V rows."""
    batch, heads, tokens, head_dim, group = 2, 3, 40, 64, 3
    records = small_integers((batch, tokens, 2, heads, head_dim), seed=3).to(dtype)
    values = records[:, :, 1].transpose(1, 2)  # [batch, heads, tokens, head_dim], at the records' strides
    slots, counts = _chosen(batch, tokens, (37, 5), seed=4)
    weights = small_integers((batch, heads, group, slots.shape[1]), seed=5)
    out = _weighted(values, slots, counts, weights, 0, rows=records)
    expected = _weighted(values.contiguous(), slots, counts, weights, 0)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("change, message", [
    (dict(slot=120), "outside the pool"),
    (dict(slot=-1), "outside the pool"),
    (dict(count=9), "exceeds the width"),
    (dict(count=-1), "exceeds the width"),
    (dict(head_dim=12), "multiple of 8"),
    (dict(start=3), "within each weight row"),
    (dict(out_rows=1), "does not match"),
    (dict(first=1), "within their buffer"),
    (dict(first=-1), "within their buffer"),
])
def test_bad_input_is_refused_not_read(change, message):
    batch, heads, group, pool, width = 2, 1, 2, 120, 8
    head_dim = change.get("head_dim", 16)
    values = torch.zeros(batch, heads, pool, head_dim)
    slots = np.zeros((batch, width), dtype=np.int64)
    slots[1, 2] = change.get("slot", 0)
    counts = np.array([width, change.get("count", width)], dtype=np.int64)
    weights = torch.zeros(batch, heads, group, 10)
    out = torch.zeros(batch, heads, group - change.get("out_rows", 0), head_dim)
    with pytest.raises(ValueError, match=message):
        _chosen_values.weighted(values.numpy(), change.get("first", 0), *values.stride()[:3], slots, counts,
                                weights.numpy(), out.numpy(), 4, batch, heads, group, pool, width, 10,
                                change.get("start", 2), head_dim)


def test_only_pools_the_kernel_reads_are_weighed_in_place():
    assert weighs_in_place(torch.zeros(1, 2, 16, 64), group=3)
    assert weighs_in_place(torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16), group=3)
    assert not weighs_in_place(torch.zeros(1, 2, 16, 64, dtype=torch.float16), group=3)
    assert not weighs_in_place(torch.zeros(1, 2, 16, 12), group=3)
    assert not weighs_in_place(torch.zeros(1, 2, 64, 16).transpose(2, 3), group=3)
