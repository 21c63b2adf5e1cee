"""One decode step's choice of pooled tokens, and exact attention over the window plus that choice.

The host's scores of its hot pool are the raw q.k of every hot token for every
query head (hot_pool.py): they rank the hot tokens *and* are those tokens'
attention logits. So the hot part of the selection needs no keys at all. When
the compute device is the host (CPU), nothing is copied either: attention runs
over the hot pool where it lies, with the unchosen tokens' logits masked to
-inf (`hot_in_place`). On another device (CUDA), the chosen hot tokens' logits
and values are copied out and sent there (`hot_gathered`), the hot pool staying
in host DRAM. Cold picks bring their full-precision K/V from the file and get
their logits from one small product with the query (`cold_fetched`).

Attention is exact over sink + recent window (device) + the chosen tokens:
softmax(scaling * [q.K_window | q.K_chosen]) @ [V_window | V_chosen], in float32.
Token order does not change the result (up to float rounding), so the chosen
tokens are not sorted into position order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.kv.gather import select_columns


@dataclass
class Picks:
    """Per sequence, the chosen hot slots and cold slots (each ascending); k = hot + cold for every sequence."""

    hot: list[np.ndarray]
    cold: list[np.ndarray]

    @classmethod
    def top(cls, hot_scores: torch.Tensor, cold_scores: torch.Tensor, alpha: float) -> Picks:
        """The top-alpha share of the pooled tokens by score (hot [B, Nh], cold [B, Nc])."""
        pooled = hot_scores.shape[1] + cold_scores.shape[1]
        chosen = torch.cat([hot_scores, cold_scores], dim=1).topk(math.ceil(alpha * pooled), dim=1, sorted=False).indices
        chosen = np.sort(chosen.numpy(), axis=1)
        hot_used = hot_scores.shape[1]
        splits = [int(np.searchsorted(row, hot_used)) for row in chosen]
        return cls([row[:split] for row, split in zip(chosen, splits)],
                   [row[split:] - hot_used for row, split in zip(chosen, splits)])

    @property
    def hot_count(self) -> int:
        return sum(len(slots) for slots in self.hot)

    @property
    def cold_count(self) -> int:
        return sum(len(slots) for slots in self.cold)


@dataclass
class Segment:
    """Attended tokens of one source: raw logits [B, Hkv, G, n] (-inf where not chosen), values [B, Hkv, n, D],
    and their token positions [B, n] (for the attention mask)."""

    logits: torch.Tensor
    values: torch.Tensor
    positions: np.ndarray

    def to(self, device: torch.device) -> Segment:
        return Segment(self.logits.to(device), self.values.to(device), self.positions)


def hot_in_place(hot_dots: torch.Tensor, hot_values: torch.Tensor, hot_positions: np.ndarray, picks: Picks) -> Segment:
    """The chosen hot tokens where they lie (CPU): every hot token, the unchosen masked out; nothing is copied."""
    unchosen = torch.full((hot_dots.shape[0], hot_dots.shape[3]), float("-inf"))
    rows = np.repeat(np.arange(len(picks.hot)), [len(slots) for slots in picks.hot])
    unchosen[torch.from_numpy(rows), torch.from_numpy(np.concatenate(picks.hot))] = 0.0
    logits = hot_dots + unchosen[:, None, None, :]  # an additive mask: cheaper than masked_fill here
    return Segment(logits, hot_values[:, :, : hot_dots.shape[3]], hot_positions)


def hot_gathered(hot_dots: torch.Tensor, hot_values: torch.Tensor, hot_positions: np.ndarray,
                 picks: Picks) -> Segment:
    """The chosen hot tokens copied out (their logits and values only), for a compute device that is not the host."""
    width = max(len(slots) for slots in picks.hot)
    index = np.zeros((len(picks.hot), width), dtype=np.int64)
    valid = np.zeros((len(picks.hot), width), dtype=bool)
    for seq, slots in enumerate(picks.hot):
        index[seq, : len(slots)], valid[seq, : len(slots)] = slots, True
    rows = torch.from_numpy(index)
    logits = hot_dots.gather(3, rows[:, None, None, :].expand(-1, *hot_dots.shape[1:3], -1))
    logits = logits.masked_fill(~torch.from_numpy(valid)[:, None, None, :], float("-inf"))
    values = hot_values.gather(2, rows[:, None, :, None].expand(-1, hot_values.shape[1], -1, hot_values.shape[3]))
    return Segment(logits, values, np.take_along_axis(hot_positions, index, axis=1))


def cold_fetched(query: torch.Tensor, fetched: list[tuple[torch.Tensor, torch.Tensor]],
                 positions: list[np.ndarray]) -> Segment:
    """The fetched cold tokens, padded to the longest sequence's count, with logits from the query [B, Hkv, G, D]."""
    batch, heads, group, head_dim = query.shape
    width = max(keys.shape[1] for keys, _ in fetched)
    keys = query.new_zeros(batch, heads, width, head_dim)
    values = fetched[0][1].new_zeros(batch, heads, width, head_dim)
    valid = torch.zeros(batch, width, dtype=torch.bool)
    padded = np.zeros((batch, width), dtype=np.int64)
    for seq, ((seq_keys, seq_values), seq_positions) in enumerate(zip(fetched, positions)):
        count = seq_keys.shape[1]
        keys[seq, :, :count], values[seq, :, :count] = seq_keys, seq_values
        valid[seq, :count], padded[seq, :count] = True, seq_positions
    logits = torch.matmul(query, keys.transpose(2, 3)).masked_fill(~valid[:, None, None, :], float("-inf"))
    return Segment(logits, values, padded)


def window_segment(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: np.ndarray) -> Segment:
    """The device window (sink + recent + new token) as a segment; query float32 [B, Hkv, G, D] on its device."""
    logits = torch.matmul(query, keys.float().transpose(2, 3))  # [B, Hkv, G, W]
    return Segment(logits, values, np.broadcast_to(positions, (len(query), len(positions))))


@dataclass
class Partial:
    """Softmax attention over some of the attended tokens, unnormalised so that parts merge exactly
    (as flash attention merges tiles): sum_i exp(l_i - peak) v_i, sum_i exp(l_i - peak), and peak."""

    weighted: torch.Tensor  # [B, Hkv, G, D]
    total: torch.Tensor  # [B, Hkv, G, 1]
    peak: torch.Tensor  # [B, Hkv, G, 1], -inf where the segment has no token for that row

    @classmethod
    def over(cls, segments: list[Segment], scaling: float, attention_mask: torch.Tensor | None = None,
             softcap: float | None = None) -> Partial | None:
        """One softmax over the segments' tokens together (None when they hold none).

        `attention_mask`: the model's decode mask (boolean keep or additive, over all positions) or None.
        """
        segments = [segment for segment in segments if segment.values.shape[2]]
        if not segments:
            return None
        logits = torch.cat([segment.logits for segment in segments], dim=3) * scaling
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if attention_mask is not None:
            positions = np.concatenate([segment.positions for segment in segments], axis=1)
            mask = select_columns(attention_mask, positions).reshape(len(logits), 1, 1, -1)
            logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
        peak = logits.amax(dim=3, keepdim=True)
        weights = torch.exp(logits - torch.where(torch.isfinite(peak), peak, 0.0))
        weighted, start = None, 0
        for segment in segments:
            width = segment.values.shape[2]
            part = torch.matmul(weights[..., start : start + width], segment.values.float())
            weighted = part if weighted is None else weighted + part
            start += width
        return cls(weighted, weights.sum(dim=3, keepdim=True), peak)

    def merge(self, other: Partial | None) -> Partial:
        if other is None:
            return self
        peak = torch.maximum(self.peak, other.peak)  # finite: the window always holds the new token
        mine, theirs = torch.exp(self.peak - peak), torch.exp(other.peak - peak)
        return Partial(self.weighted * mine + other.weighted * theirs, self.total * mine + other.total * theirs, peak)

    def output(self, query: torch.Tensor) -> torch.Tensor:
        """Attention output [B, 1, Hq, D] in the query's dtype (the layout transformers' attention functions return)."""
        batch, q_heads, _, head_dim = query.shape
        return (self.weighted / self.total).reshape(batch, q_heads, head_dim)[:, None].to(query.dtype)
