"""Low-precision key sketches: what the storage-side scorer reads to rank cold tokens.

A sketch is one token's key of one layer (all KV heads), quantized symmetrically
to INT8 or INT4 in groups of `group` dimensions, each group with its own fp16
scale. It exists only for *scoring* (the HillInfer paper's "asymmetric precision"):
the selected tokens are always fetched in full precision afterwards.

Record layout (one token, little endian, no padding):
    scales  float16 [heads * groups_per_head]
    codes   int8 [heads * head_dim]          (INT8)
            uint8 [heads * head_dim / 2]     (INT4: two's-complement nibbles, low nibble = even dim)

INT4 sketches of an fp16 key are 1/4 of its bytes and 1/8 of the K+V bytes,
the floor of the scorer's I/O per step.

Scoring computes raw inner products only (no softmax, no 1/sqrt(d)): ranking
is all selection needs, and softmax is monotonic. It reads the codes as they
lie (sketch_scores.c). This module depends on numpy and that extension only,
so the scorer process starts without importing torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvtier.errors import ConfigError
from kvtier.kernels import ops

SCORE_BITS = (8, 4)
AGGREGATIONS = ("sum", "max")
_QMAX = {8: 127, 4: 7}


@dataclass(frozen=True)
class SketchFormat:
    """Byte layout of one token's key sketch for a layer of `heads` KV heads of `head_dim`."""

    bits: int
    heads: int
    head_dim: int
    group: int = 32

    def __post_init__(self) -> None:
        if self.bits not in SCORE_BITS:
            raise ConfigError(f"score bits must be one of {SCORE_BITS}, got {self.bits}")
        if self.head_dim % self.group:
            raise ConfigError(f"sketch group {self.group} must divide head_dim {self.head_dim}")
        if self.bits == 4 and self.group % 2:
            raise ConfigError("INT4 sketches need an even group size")

    @classmethod
    def for_keys(cls, bits: int, heads: int, head_dim: int) -> SketchFormat:
        """Groups of 32 dims (one scale per 32 values, as common INT4/INT8 schemes), or one per head if smaller."""
        return cls(bits, heads, head_dim, group=math.gcd(32, head_dim))

    @property
    def groups(self) -> int:
        """Scale groups per token (over all heads)."""
        return self.heads * self.head_dim // self.group

    @property
    def code_bytes(self) -> int:
        return self.heads * self.head_dim * self.bits // 8

    @property
    def record_bytes(self) -> int:
        return 2 * self.groups + self.code_bytes


def quantize(keys: np.ndarray, fmt: SketchFormat) -> np.ndarray:
    """Sketch records (uint8 [tokens, record_bytes]) of float keys shaped [tokens, heads, head_dim]."""
    tokens = keys.shape[0]
    # C order matters: numpy keeps a strided input's layout in the scales, which then cannot be viewed as bytes.
    grouped = np.ascontiguousarray(keys, dtype=np.float32).reshape(tokens, fmt.groups, fmt.group)
    qmax = _QMAX[fmt.bits]
    scales = (np.abs(grouped).max(axis=2) / qmax).astype(np.float16)
    # Divide by the *stored* (fp16-rounded) scale so that decoding with it is consistent.
    safe = np.where(scales == 0, np.float16(1), scales).astype(np.float32)
    codes = np.clip(np.rint(grouped / safe[:, :, None]), -qmax, qmax).astype(np.int8).reshape(tokens, -1)
    if fmt.bits == 4:
        nibbles = codes.view(np.uint8) & 0x0F
        codes = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).view(np.int8)
    records = np.empty((tokens, fmt.record_bytes), dtype=np.uint8)
    records[:, : 2 * fmt.groups] = scales.view(np.uint8).reshape(tokens, -1)
    records[:, 2 * fmt.groups :] = codes.view(np.uint8)
    return records


def score(records: np.ndarray, query: np.ndarray, fmt: SketchFormat, aggregation: str,
          out: np.ndarray | None = None) -> np.ndarray:
    """Raw inner-product importance (float32 [tokens]) of sketch records for one sequence's query.

    `query` is float32 [heads, q_per_head, head_dim]: for "sum" the query heads of a GQA group
    already summed (q_per_head = 1), so the score is the sum over all heads of q_h . k
    (sum_h q_h.k = (sum_h q_h).k), one dot product per token; for "max" every query head, and the
    score is the max over heads.

    Scored from the codes in one compiled call (sketch_scores.c), without dequantizing: its result
    does not depend on a thread count, so the scorer process and the host fallback agree bit for bit.
    `out`: a contiguous float32 array of at least `len(records)` values to write into.
    """
    records = np.ascontiguousarray(records, dtype=np.uint8)
    out = np.empty(len(records), dtype=np.float32) if out is None else out[: len(records)]
    ops.sketch_scores(records, np.ascontiguousarray(query, dtype=np.float32), out, bits=fmt.bits, heads=fmt.heads,
                      head_dim=fmt.head_dim, group=fmt.group, aggregation=aggregation)
    return out
