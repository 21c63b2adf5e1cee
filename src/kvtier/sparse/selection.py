"""One decode step's choice of pooled tokens, and exact attention over the window plus that choice.

The host's scores of its hot pool are the raw q.k of every hot token for every
query head (hot_pool.py): they rank the hot tokens *and* are those tokens'
attention logits. So the hot part of the selection needs no keys at all: the
chosen tokens' logits are picked out of the scores. On the CPU their values
are then read where they lie in the pool, once, by the weighted sum itself
(`chosen_in_place`, chosen_values.c): copying them out first, then
multiplying, wrote and read them again, and attending over the whole pool
with the unchosen masked out reads every hot value (docs/decisions.md).
Elsewhere (CUDA: the hot pool stays in host DRAM) the chosen values are copied
out (`chosen_copied`) and sent to the compute device.
Cold tokens are chosen the same way: the key sketches only draw up a shortlist
(`shortlist`, or the lookahead's candidates), `margin` x the cold tokens they
would have chosen, whose full-precision K/V are read and get their logits from
one small product with the query over the records where the reads landed
(`candidate_scores`); the top-alpha then ranks hot pool and shortlist by exact
q.k, and the chosen candidates' values are weighed where they lie too. So the
sketches' precision narrows the choice but never makes it: an INT4 sketch
loses no recall against INT8 once the shortlist is re-ranked
(docs/decisions.md).

Attention is exact over sink + recent window (device) + the chosen tokens:
softmax(scaling * [q.K_window | q.K_chosen]) @ [V_window | V_chosen], in float32.
Token order does not change the result (up to float rounding), so the chosen
tokens are not sorted into position order. The cold reads land while the host
builds the other segments; one softmax then covers them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.kv.gather import select_columns
from kvtier.sparse import _chosen_values
from kvtier.sparse.hot_pool import importance
from kvtier.sparse.top_share import top_share

MIN_CANDIDATES = 16  # the fewest cold tokens a sequence's shortlist holds (where the pool has them)


@dataclass
class Picks:
    """Per sequence, the chosen hot slots and cold slots (each ascending), and the chosen tokens' positions [B, k],
    each row its hot ones first; k = hot + cold for every sequence."""

    hot: list[np.ndarray]
    cold: list[np.ndarray]
    positions: np.ndarray

    @classmethod
    def top(cls, hot_scores: torch.Tensor, cold_scores: torch.Tensor, positions: np.ndarray, alpha: float,
            pooled: int | None = None) -> Picks:
        """The top-alpha share of the pooled tokens by score (hot [B, Nh], cold [B, Nc]; `positions` [B, Nh + Nc] the
        scored tokens'); `pooled`: the pool's size when the cold scores cover only some of its cold tokens (the
        lookahead's candidates)."""
        scores = np.concatenate([hot_scores.numpy(), cold_scores.numpy()], axis=1)
        pooled = scores.shape[1] if pooled is None else pooled
        chosen = top_share(scores, min(math.ceil(alpha * pooled), scores.shape[1]))
        hot_used = hot_scores.shape[1]
        splits = (chosen < hot_used).sum(axis=1).tolist()  # ascending rows: the hot slots come first
        flat = chosen + np.arange(len(chosen))[:, None] * positions.shape[1]  # take_along_axis took 3x as long
        return cls([row[:split] for row, split in zip(chosen, splits)],
                   [row[split:] - hot_used for row, split in zip(chosen, splits)],
                   np.ascontiguousarray(positions).reshape(-1).take(flat))

    @property
    def cold_positions(self) -> list[np.ndarray]:
        """Per sequence, the positions of the chosen cold tokens: the tail of its row."""
        return [row[len(hot) :] for row, hot in zip(self.positions, self.hot)]

    @property
    def hot_count(self) -> int:
        return sum(len(slots) for slots in self.hot)

    @property
    def cold_count(self) -> int:
        return sum(len(slots) for slots in self.cold)


def candidate_counts(margin: float, cold_picked: np.ndarray, cold_tokens: int, least: int) -> np.ndarray:
    """Shortlist sizes per sequence: `margin` x its cold picks `cold_picked`, at least MIN_CANDIDATES and `least`,
    at most the pool's `cold_tokens`."""
    wanted = np.maximum(np.ceil(margin * cold_picked).astype(np.int64), max(MIN_CANDIDATES, least))
    return np.minimum(wanted, cold_tokens)


def shortlist(hot_scores: np.ndarray, cold_scores: np.ndarray, alpha: float, margin: float,
              least: int) -> list[np.ndarray]:
    """Per sequence, the cold slots (ascending) to read and rank exactly: the best by their sketch scores
    (`cold_scores` [B, Nc]), `candidate_counts` of how many the top-alpha over them and the hot scores [B, Nh]
    would take from the cold pool."""
    scores = np.concatenate([hot_scores, cold_scores], axis=1)
    chosen = top_share(scores, min(math.ceil(alpha * scores.shape[1]), scores.shape[1]))
    picked = (chosen >= hot_scores.shape[1]).sum(axis=1)
    counts = candidate_counts(margin, picked, cold_scores.shape[1], least)
    return [top_share(row[None], int(count))[0] for row, count in zip(cold_scores, counts)]


@dataclass
class Segment:
    """Attended tokens of one source: raw logits [B, Hkv, G, n] (-inf where not chosen), values [B, Hkv, n, D],
    and their token positions [B, n] (for the attention mask)."""

    logits: torch.Tensor
    values: torch.Tensor
    positions: np.ndarray

    @property
    def width(self) -> int:
        return self.logits.shape[3]

    def to(self, device: torch.device) -> Segment:
        return Segment(self.logits.to(device), self.values.to(device), self.positions)

    def weighted(self, weights: torch.Tensor, start: int) -> torch.Tensor:
        """sum_j w_j v_j [B, Hkv, G, D] float32, the weights of this segment's tokens being `weights`' [..., start:]."""
        return torch.matmul(weights[..., start : start + self.width], self.values.float())


@dataclass
class PooledSegment(Segment):
    """Chosen tokens attended where they lie: `values` [B, Hkv, slots, D] is their whole source (the hot pool, or the
    candidates' records), at any strides but the last, `slots` [B, n] each sequence's chosen slots (padded), `counts`
    [B] how many are its own."""

    slots: np.ndarray
    counts: np.ndarray

    def to(self, device: torch.device) -> Segment:
        if device.type != "cpu":
            raise ValueError(f"the chosen values lie in host memory: attend them there, not on {device}")
        return self

    def weighted(self, weights: torch.Tensor, start: int) -> torch.Tensor:
        weights = weights.contiguous()
        batch, heads, group, stride = weights.shape
        out = torch.empty(batch, heads, group, self.values.shape[3])
        bf16 = self.values.dtype == torch.bfloat16
        elements = self.values.untyped_storage().nbytes() // self.values.element_size()
        storage = self.values.as_strided((elements,), (1,), 0)  # the rows' whole buffer; the strides locate them
        _chosen_values.weighted((storage.view(torch.int16) if bf16 else storage).numpy(), self.values.storage_offset(),
                                *self.values.stride()[:3], self.slots, self.counts, weights.numpy(), out.numpy(),
                                2 if bf16 else 4, batch, heads, group, self.values.shape[2], self.width, stride, start,
                                self.values.shape[3])
        return out


def weighs_in_place(values: torch.Tensor, group: int) -> bool:
    """Whether the compiled weighted sum (chosen_values.c) takes chosen values from `values` [B, Hkv, slots, D] for
    `group` query heads per KV head: in host memory, each row contiguous, float32 or bfloat16, head_dim a multiple of
    8, a CPU with AVX2 and FMA."""
    return (_chosen_values.vectorized and values.device.type == "cpu" and values.stride(3) == 1
            and values.dtype in (torch.float32, torch.bfloat16) and values.shape[3] % 8 == 0
            and group * values.shape[3] <= _chosen_values.max_accumulators)


def _chosen_columns(dots: torch.Tensor, positions: np.ndarray,
                    chosen: list[np.ndarray]) -> tuple[np.ndarray, torch.Tensor, np.ndarray]:
    """Each sequence's `chosen` slots [B, n] (padded with slot 0), their logits picked out of `dots` [B, Hkv, G, slots]
    (the padding's -inf) and their positions (out of `positions` [B, slots])."""
    width = max(len(slots) for slots in chosen)
    index = np.zeros((len(chosen), width), dtype=np.int64)
    for seq, slots in enumerate(chosen):
        index[seq, : len(slots)] = slots
    rows = torch.from_numpy(index)
    logits = dots.gather(3, rows[:, None, None, :].expand(-1, *dots.shape[1:3], -1))
    for seq, slots in enumerate(chosen):
        if len(slots) < width:  # the padding
            logits[seq, :, :, len(slots) :] = float("-inf")
    flat = index + np.arange(len(index))[:, None] * positions.shape[1]  # take_along_axis took 5x as long
    return index, logits, np.ascontiguousarray(positions).reshape(-1).take(flat)


def chosen_copied(dots: torch.Tensor, values: torch.Tensor, positions: np.ndarray, chosen: list[np.ndarray]) -> Segment:
    """The `chosen` slots of a source (logits `dots` [B, Hkv, G, slots], `values` [B, Hkv, slots, D], `positions`
    [B, slots]): their logits picked out, their values copied out (each sequence padded to the most chosen, the
    padding's logits -inf)."""
    index, logits, chosen_positions = _chosen_columns(dots, positions, chosen)
    rows = torch.from_numpy(index)
    out = values.new_empty(len(rows), values.shape[1], rows.shape[1], values.shape[3])
    for seq in range(len(rows)):  # index_select per sequence: a batched gather of the rows was ~18x slower on the CPU
        torch.index_select(values[seq], 1, rows[seq], out=out[seq])
    return Segment(logits, out, chosen_positions)


def chosen_in_place(dots: torch.Tensor, values: torch.Tensor, positions: np.ndarray,
                    chosen: list[np.ndarray]) -> PooledSegment:
    """The `chosen` slots as `chosen_copied` gives them, but their values left where they lie (`weighs_in_place`
    must hold): the weighted sum reads them there."""
    index, logits, chosen_positions = _chosen_columns(dots, positions, chosen)
    counts = np.array([len(slots) for slots in chosen], dtype=np.int64)
    return PooledSegment(logits, values, chosen_positions, index, counts)


def candidates_in_place(logits: torch.Tensor, values: torch.Tensor, positions: np.ndarray,
                        counts: np.ndarray) -> PooledSegment:
    """The cold candidates as a segment whose values are read where the reads landed (`weighs_in_place` must hold):
    `logits` [B, Hkv, G, width] (-inf where not chosen), `values` [B, Hkv, width, D], sequence s's own the first
    counts[s]. The sum reads every own row, weighted 0 if not chosen: they are few (about twice the chosen), and
    picking the chosen out first cost more at batch 1 than it saved."""
    slots = np.tile(np.arange(values.shape[2], dtype=np.int64), (len(counts), 1))
    return PooledSegment(logits, values, positions, slots, counts)


def candidate_scores(query: torch.Tensor, keys: torch.Tensor, counts: np.ndarray,
                     aggregation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The cold candidates' exact q.k [B, Hkv, G, width] for the query [B, Hkv, G, D] over their keys [B, Hkv, width,
    D] (sequence s's own the first counts[s]; the rest padding, whatever it holds), and their importance [B, width],
    the padding's -inf: never among the top."""
    # the keys copied out of the records first: torch's product over their strides took twice as long at batch 8;
    # numpy's product, faster still, runs OpenBLAS threads that take the scorer's core (docs/decisions.md)
    dots = torch.matmul(query, keys.float().contiguous().transpose(2, 3))
    padding = torch.from_numpy(np.arange(keys.shape[2]) >= counts[:, None])
    return dots, importance(dots, aggregation).masked_fill_(padding, float("-inf"))


def window_segment(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: np.ndarray) -> Segment:
    """The device window (sink + recent + new token) as a segment; query float32 [B, Hkv, G, D] on its device."""
    logits = torch.matmul(query, keys.float().transpose(2, 3))  # [B, Hkv, G, W]
    return Segment(logits, values, np.broadcast_to(positions, (len(query), len(positions))))


def exact_attention(segments: list[Segment], query: torch.Tensor, scaling: float,
                    attention_mask: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """One softmax over the segments' tokens together; the output [B, 1, Hq, D] in the query's dtype (the layout
    transformers' attention functions return).

    `attention_mask`: the model's decode mask (boolean keep or additive, over all positions) or None. The device
    window holds the new token, never masked, so every row's peak is finite; the in-place steps below rely on it
    (each op on a [B, Hkv, G, tokens] tensor is a pass over it, and this runs once per layer and step).
    """
    segments = [segment for segment in segments if segment.width]
    logits = torch.cat([segment.logits for segment in segments], dim=3).mul_(scaling)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if attention_mask is not None:
        positions = np.concatenate([segment.positions for segment in segments], axis=1)
        mask = select_columns(attention_mask, positions).reshape(len(logits), 1, 1, -1)
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    weights = logits.sub_(logits.amax(dim=3, keepdim=True)).exp_()
    weighted, start = None, 0
    for segment in segments:
        part = segment.weighted(weights, start)
        weighted = part if weighted is None else weighted.add_(part)
        start += segment.width
    batch, q_heads, _, head_dim = query.shape
    return weighted.div_(weights.sum(dim=3, keepdim=True)).reshape(batch, q_heads, head_dim)[:, None].to(query.dtype)
