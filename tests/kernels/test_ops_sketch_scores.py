"""The sketch scores' arguments checked before the kernel reads them (the scores themselves:
tests/sparse/cold/test_sketch.py)."""

import numpy as np
import pytest

from kvtier.kernels import ops

HEADS, HEAD_DIM, GROUP, TOKENS = 2, 64, 32, 5
RECORD_BYTES = 2 * HEADS * HEAD_DIM // GROUP + HEADS * HEAD_DIM  # INT8: scales, then codes


def _call(**change):
    call = {"records": np.zeros((TOKENS, RECORD_BYTES), dtype=np.uint8),
            "query": np.zeros((HEADS, 1, HEAD_DIM), dtype=np.float32), "out": np.full(TOKENS, np.nan, np.float32),
            "bits": 8, "heads": HEADS, "head_dim": HEAD_DIM, "group": GROUP, "aggregation": "sum"} | change
    ops.sketch_scores(**call)
    return call["out"]


def test_zero_codes_score_zero():
    assert _call().tolist() == [0.0] * TOKENS


@pytest.mark.parametrize("change, message", [
    (dict(bits=2), "^bits, heads, head_dim, group: 2-bit codes"),
    (dict(group=0), "^bits, heads, head_dim, group: .*groups of 0 are no sketch format$"),
    (dict(heads=0), "^bits, heads, head_dim, group: .*of 0 heads"),
    (dict(group=24), "^bits, heads, head_dim, group: .*of 64 dims in groups of 24"),
    (dict(records=np.zeros((TOKENS, RECORD_BYTES + 1), dtype=np.uint8)),
     f"^records: {TOKENS * (RECORD_BYTES + 1)} bytes is not a whole number of {RECORD_BYTES}-byte records$"),
    (dict(records=np.zeros((TOKENS, RECORD_BYTES), dtype=np.int8)), "^records: int8"),
    (dict(query=np.zeros((HEADS, 1, HEAD_DIM))), "^query: float64"),
    (dict(query=np.zeros((HEADS, 1, 2 * HEAD_DIM), dtype=np.float32)[..., ::2]), "^query: .*not C-contiguous"),
    (dict(query=np.zeros((HEADS, 1, HEAD_DIM - 1), dtype=np.float32)), "^query: .*does not fit 2 heads of 64 dims$"),
    (dict(query=np.zeros(0, dtype=np.float32)), "^query: .*does not fit"),
    (dict(out=np.zeros(TOKENS - 1, dtype=np.float32)), "^out: holds fewer float32 values \\(4\\) than there are"),
    (dict(out=np.zeros((TOKENS, 1), dtype=np.float32)), "^out: shape \\(5, 1\\), need 1 dimensions$"),
    (dict(aggregation="mean"), "^aggregation: 'mean'"),
])
def test_bad_arguments_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        _call(**change)


def test_records_of_any_shape_and_a_longer_out_are_taken():
    """Flat record bytes score as rows of records; an out longer than the records keeps its tail."""
    out = np.full(TOKENS + 2, np.nan, np.float32)
    _call(records=np.zeros(TOKENS * RECORD_BYTES, dtype=np.uint8), out=out)
    assert out[:TOKENS].tolist() == [0.0] * TOKENS and np.isnan(out[TOKENS:]).all()
