import numpy as np
import pytest
import torch
from exact_values import small_integers

from kvtier.kernels import ops
from kvtier.sparse.selection import weighs_in_place

pytestmark = pytest.mark.skipif(not ops.VECTORIZED, reason="the kernel needs AVX2 and FMA")


def _rows(values, buffer=None):
    """`values` [batch, heads, pool, head_dim] as ops.Rows, viewed in `buffer` (its buffer) where given."""
    buffer = values if buffer is None else buffer
    bits = buffer.view(torch.int16) if buffer.dtype == torch.bfloat16 else buffer
    return ops.Rows(bits.numpy(), values.storage_offset(), values.stride()[:3], values.shape)


def _weighted(values, slots, counts, weights, start, rows=None):
    """The kernel's sum over `values` [batch, heads, pool, head_dim], viewed in `rows` (its buffer) where given."""
    batch, heads, group, _ = weights.shape
    out = torch.full((batch, heads, group, values.shape[3]), float("nan"))
    ops.weighted_values(values=_rows(values, rows), slots=slots, counts=counts, weights=weights.numpy(),
                        out=out.numpy(), start=start)
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
    (dict(start=3), "^start: .*within each weight row"),
    (dict(start=-1), "^start: .*within each weight row"),
    (dict(out_rows=1), "^weights: shape .* does not match"),
    (dict(first=1), "within their buffer"),
    (dict(first=-1), "within their buffer"),
    (dict(slots_dtype=np.int32), "^slots: int32"),
    (dict(counts_length=3), "^counts: shape .* does not match"),
    (dict(weights_dtype=np.float64), "^weights: float64"),
    (dict(values_heads=2), "^values: shape .* does not match out's"),
])
def test_bad_input_is_refused_not_read(change, message):
    batch, heads, group, pool, width = 2, 1, 2, 120, 8
    head_dim = change.get("head_dim", 16)
    values = torch.zeros(batch, change.get("values_heads", heads), pool, head_dim)
    slots = np.zeros((batch, width), dtype=change.get("slots_dtype", np.int64))
    slots[1, 2] = change.get("slot", 0)
    counts = np.array([width, change.get("count", width)] + [0] * (change.get("counts_length", 2) - 2), dtype=np.int64)
    weights = np.zeros((batch, heads, group, 10), dtype=change.get("weights_dtype", np.float32))
    out = torch.zeros(batch, heads, group - change.get("out_rows", 0), head_dim)
    rows = ops.Rows(values.numpy(), change.get("first", 0), values.stride()[:3], values.shape)
    with pytest.raises(ValueError, match=message):
        ops.weighted_values(values=rows, slots=slots, counts=counts, weights=weights, out=out.numpy(),
                            start=change.get("start", 2))


def test_only_pools_the_kernel_reads_are_weighed_in_place():
    assert weighs_in_place(torch.zeros(1, 2, 16, 64), group=3)
    assert weighs_in_place(torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16), group=3)
    assert not weighs_in_place(torch.zeros(1, 2, 16, 64, dtype=torch.float16), group=3)
    assert not weighs_in_place(torch.zeros(1, 2, 16, 12), group=3)
    assert not weighs_in_place(torch.zeros(1, 2, 64, 16).transpose(2, 3), group=3)


def _attend(sources, batch, heads, group, head_dim, scaling):
    out = torch.full((batch, heads, group, head_dim), float("nan"))
    ops.attend(sources=tuple(sources), out=out.numpy(), scaling=scaling)
    return out


def _source(logits, values, slots=None, counts=None):
    return ops.Source(logits=logits.numpy(), values=_rows(values), slots=slots, counts=counts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group, head_dim", [(1, 8), (3, 64), (7, 64), (4, 40)])
@pytest.mark.parametrize("spread", [1.0, 60.0])
def test_attention_over_sources_equals_the_softmax_over_their_chosen_rows(dtype, group, head_dim, spread):
    """A whole source (every row, slot j its row j) beside pooled ones (chosen slots, fewer for one sequence, the
    unchosen -inf); logits from near-equal to spread so wide that most weights underflow to 0."""
    batch, heads, pool, scaling = 2, 3, 90, 0.125
    gen = torch.Generator().manual_seed(group * head_dim)
    window = torch.randn(batch, heads, 13, head_dim, generator=gen).to(dtype)
    pooled = torch.randn(batch, heads, pool, head_dim, generator=gen).to(dtype)
    slots, counts = _chosen(batch, pool, (41, 9), seed=group)
    logits = [torch.randn(batch, heads, group, width, generator=gen) * spread for width in (13, slots.shape[1], pool)]
    logits[2][..., 5::3] = float("-inf")  # a candidates' source: the unchosen masked
    cold_counts = np.array([pool, 60], dtype=np.int64)
    every_slot = np.tile(np.arange(pool, dtype=np.int64), (batch, 1))
    out = _attend([_source(logits[0], window), _source(logits[1], pooled, slots, counts),
                   _source(logits[2], pooled, every_slot, cold_counts)], batch, heads, group, head_dim, scaling)
    for seq in range(batch):
        chosen = torch.from_numpy(slots[seq, : counts[seq]])
        seq_logits = torch.cat([logits[0][seq], logits[1][seq][..., : counts[seq]],
                                logits[2][seq][..., : cold_counts[seq]]], dim=-1)
        values = torch.cat([window[seq], pooled[seq][:, chosen], pooled[seq][:, : cold_counts[seq]]], dim=1).float()
        expected = torch.matmul((seq_logits * scaling).softmax(-1), values)
        torch.testing.assert_close(out[seq], expected, rtol=2e-5, atol=2e-6)


def test_the_exponentials_are_those_of_expf_and_nothing_below_the_range():
    """One source of one row per logit: the output is the softmax's weight of the row holding 1 (exp of the logit less
    the peak, over their sum), across the float's range down to -inf."""
    logits = torch.tensor([0.0, -1e-6, -0.3466, -0.5, -1.0, -7.25, -20.0, -50.0, -86.9, -87.5, -103.0, -1e30,
                           float("-inf"), -3.0, -0.6931, -10.0])
    width = len(logits)
    values = torch.zeros(1, 1, width, 8)
    for row in range(width):
        values[0, 0, row, row % 8] = 1.0  # a weight w_j appears in the output's column j % 8
    out = _attend([_source(logits.view(1, 1, 1, width), values)], 1, 1, 1, 8, 1.0)[0, 0, 0]
    weights = torch.exp(logits.double())
    expected = (weights / weights.sum()).view(2, 8).sum(0).float()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("change, message", [
    (dict(slot=90), "outside the pool"),
    (dict(count=3), "exceeds the width"),
    (dict(logits=1), "^sources\\[1\\].slots: shape .* does not match its logits'"),
    (dict(width=91), "more rows than the pool"),
    (dict(first=1), "within their buffer"),
    (dict(value_dtype=np.float64), "^sources\\[1\\].values.buffer: float64 .*need C-contiguous float32 or int16"),
    (dict(sources=0), "^sources: 0 of them, attend takes 1 to 8 sources"),
    (dict(sources=9), "^sources: 9 of them, attend takes 1 to 8 sources"),
    (dict(logits_group=1), "^sources\\[1\\].logits: shape .* does not match out's"),
    (dict(counts_dtype=np.int32), "^sources\\[1\\].counts: int32"),
    (dict(values_dim=16), "^sources\\[1\\].values: shape .* does not match out's"),
])
def test_bad_sources_are_refused_not_read(change, message):
    batch, heads, group, head_dim, pool = 2, 1, 2, 8, 90
    values = torch.zeros(batch, heads, pool, head_dim)
    pooled_values = np.zeros((batch, heads, pool, change.get("values_dim", head_dim)),
                             dtype=change.get("value_dtype", np.float32))
    slots = np.zeros((batch, 2), dtype=np.int64)
    slots[1, 1] = change.get("slot", 0)
    pooled = ops.Source(np.zeros((batch, heads, change.get("logits_group", group), 2 + change.get("logits", 0)),
                                 dtype=np.float32),
                        ops.Rows(pooled_values, change.get("first", 0), values.stride()[:3], pooled_values.shape),
                        slots, np.array([2, change.get("count", 2)], dtype=change.get("counts_dtype", np.int64)))
    width = change.get("width", pool)
    whole = ops.Source(torch.zeros(batch, heads, group, width).numpy(),
                       ops.Rows(values.numpy(), 0, values.stride()[:3], values.shape))
    sources = (whole, pooled) if "sources" not in change else (whole,) * change["sources"]
    out = torch.zeros(batch, heads, group, head_dim)
    with pytest.raises(ValueError, match=message):
        ops.attend(sources=sources, out=out.numpy(), scaling=1.0)


def test_a_source_that_is_not_a_source_tuple_is_refused():
    out = torch.zeros(1, 1, 1, 8)
    with pytest.raises(TypeError, match="^sources\\[0\\]: a source is a Source"):
        ops.attend(sources=((1, 2),), out=out.numpy(), scaling=1.0)
