"""Attention over paged KV blocks, plugged into transformers as the `kvtier_paged` implementation.

Like vLLM's attention backends, the attention function itself does both halves
of the KV work for a layer: it stores the new tokens' K/V into their pool slots,
then attends each sequence's queries over that sequence's blocks. So the model
runs with `use_cache=False` and no transformers `Cache` object: the pool, block
tables and slots travel in one `PagedBatch` passed as the model kwarg
`paged_batch`, which transformers forwards untouched to every attention call.

Tokens of all sequences in a forward are packed along one row ([1, N], like
vLLM's flattened batch), so a step can mix prefill chunks and decode tokens of
ragged lengths. A tiered sequence's tokens go to its own KV (tiered.py), which
stores and attends them; the rest are stored into the pool, and each
sequence is attended separately with SDPA over its own gathered blocks; a query at position p sees keys 0..p, and on sliding-window
layers (Gemma 3) only the last `sliding_window` of them.

No mask function is registered on purpose: for an attention implementation
missing from `AttentionMaskInterface`, transformers skips building the dense
[batch, 1, q, kv] mask (meaningless for packed ragged sequences), and this
module applies causality and the sliding window itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvtier.errors import ModelError
from kvtier.engine.kv_pool import KVPool
from kvtier.engine.tiered import SequenceKV

ATTENTION_NAME = "kvtier_paged"


@dataclass(frozen=True)
class Segment:
    """The packed tokens [start, start + length) of one sequence, at positions first_position onwards: a paged
    sequence's with its block table, or a tiered sequence's with its KV (which stores and attends them itself)."""

    start: int
    length: int
    first_position: int
    block_table: torch.Tensor | None  # long, the blocks covering positions 0 .. first_position + length - 1
    kv: SequenceKV | None = None

    @property
    def context_length(self) -> int:
        return self.first_position + self.length


@dataclass(frozen=True)
class PagedBatch:
    """Everything one forward needs to find and store KV: the pool, each token's slot, each sequence's blocks."""

    pool: KVPool
    slot_blocks: torch.Tensor  # long [M]: pool block of each packed token of a paged sequence
    slot_offsets: torch.Tensor  # long [M]: offset of the token inside that block
    segments: tuple[Segment, ...]
    paged_rows: torch.Tensor | None = None  # long [M]: which packed tokens those are; None: all N


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    sliding_window: int | None = None, softcap: float | None = None,
                    paged_batch: PagedBatch | None = None, **_: object) -> tuple[torch.Tensor, None]:
    """transformers attention function: store K/V [1, Hkv, N, D], return attention output [1, N, H, D]."""
    if paged_batch is None:
        raise ModelError(f"attention '{ATTENTION_NAME}' needs a paged_batch: run the model through kvtier.engine")
    if softcap is not None:
        raise ModelError("paged attention does not implement attention logit soft-capping; use a model without it")
    layer = module.layer_idx
    pool = paged_batch.pool
    keys, values = pool.keys(layer), pool.values(layer)
    rows = paged_batch.paged_rows
    paged_keys, paged_values = (key[0], value[0]) if rows is None else (key[0][:, rows], value[0][:, rows])
    keys[paged_batch.slot_blocks, paged_batch.slot_offsets] = paged_keys.transpose(0, 1).to(keys.dtype)
    values[paged_batch.slot_blocks, paged_batch.slot_offsets] = paged_values.transpose(0, 1).to(values.dtype)
    window = sliding_window or getattr(module, "sliding_window", None)
    outputs = []
    for seg in paged_batch.segments:
        span = slice(seg.start, seg.start + seg.length)
        if seg.kv is None:
            outputs.append(_attend_one(query[:, :, span], keys, values, seg, scaling, window))
        else:
            outputs.append(seg.kv.attend(module, query[:, :, span], key[:, :, span], value[:, :, span], scaling,
                                         window))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _attend_one(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, segment: Segment,
                scaling: float | None, window: int | None) -> torch.Tensor:
    length = segment.context_length
    k = _gather(keys, segment.block_table, length).to(query.dtype)
    v = _gather(values, segment.block_table, length).to(query.dtype)
    mask = causal_mask(segment.length, length, window, query.device)
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)


def _gather(pool: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of a sequence's blocks as [1, Hkv, length, D]."""
    heads, dim = pool.shape[2:]
    gathered = pool[block_table].reshape(-1, heads, dim)[:length]
    return gathered.permute(1, 0, 2).unsqueeze(0)


def causal_mask(queries: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean [q, k] mask (True = attend) of a sequence's last `queries` positions over its last `keys` positions,
    causal and within `window`; None when every query may see every key."""
    if queries == 1 and (window is None or keys <= window):
        return None
    positions = torch.arange(keys - queries, keys, device=device)[:, None]
    key_positions = torch.arange(keys, device=device)[None, :]
    allowed = key_positions <= positions
    if window is not None:
        allowed &= key_positions > positions - window
    return allowed


def register() -> str:
    """Make `kvtier_paged` known to transformers (idempotent); returns its name for set_attn_implementation."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
