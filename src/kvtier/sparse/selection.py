"""One decode step's choice of pooled tokens, and exact attention over the window plus that choice.

The host's scores of its hot pool are the raw q.k of every hot token for every
query head (hot_pool.py): they rank the hot tokens *and* are those tokens'
attention logits. So the hot part of the selection needs no keys at all: the
chosen tokens' logits are picked out of the scores. On the CPU their values
are then read where they lie in the pool, once, by the weighted sum itself
(`chosen_in_place`, chosen_values.c): copying them out first, then
multiplying, wrote and read them again, and attending over the whole pool
with the unchosen masked out reads every hot value.
Elsewhere (CUDA: the hot pool stays in host DRAM) the chosen values are copied
out (`chosen_copied`) and sent to the compute device.
Cold tokens are chosen the same way: the key sketches only draw up a shortlist
(`shortlist`, or the lookahead's candidates), `margin` x the cold tokens they
would have chosen, whose full-precision K/V are read and get their logits from
one small product with the query over the records where the reads landed
(`candidate_scores`); the top-alpha then ranks hot pool and shortlist by exact
q.k, and the chosen candidates' values are weighed where they lie too. So the
sketches' precision narrows the choice but never makes it: an INT4 sketch
loses no recall against INT8 once the shortlist is re-ranked.

Attention is exact over sink + recent window (device) + the chosen tokens:
softmax(scaling * [q.K_window | q.K_chosen]) @ [V_window | V_chosen], in float32.
Token order does not change the result (up to float rounding), so the chosen
tokens are not sorted into position order. The cold reads land while the host
builds the other segments; one softmax then covers them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from kvtier.kv.gather import select_columns
from kvtier.kernels import ops
from kvtier.sparse.hot.hot_pool import importance

MIN_CANDIDATES = 16  # the fewest cold tokens a sequence's shortlist holds (where the pool has them)


@dataclass
class Picks:
    """The top-alpha's choice: per sequence (row), the indices [B, k] of its chosen tokens, ascending, among its hot
    pool's `hot_used` tokens followed by its scored cold tokens, so each row's hot ones come first (`hot_counts` [B] of
    them), and those hot slots again, padded with slot 0 [B, k]; the chosen tokens' positions [B, k]; and which of the
    scored cold tokens were chosen, `cold_chosen` [B, Nc]. Kept in these arrays, not split into a list per sequence:
    most steps need no sequence's own."""

    chosen: np.ndarray
    hot_counts: np.ndarray
    hot_used: int
    padded_hot: np.ndarray
    positions: np.ndarray
    cold_chosen: np.ndarray

    @classmethod
    def top(cls, hot_scores: torch.Tensor, cold_scores: torch.Tensor, hot_positions: np.ndarray,
            cold_positions: np.ndarray, alpha: float, pooled: int | None = None) -> Picks:
        """The top-alpha share of the pooled tokens by score (hot [B, Nh], cold [B, Nc]; `hot_positions` [B, Nh] and
        `cold_positions` [B, Nc] the scored tokens'); `pooled`: the pool's size when the cold scores cover only some
        of its cold tokens (the lookahead's candidates). Ranked and split in two compiled calls (top_share.c): joining
        the scores and the positions first, and splitting in numpy, cost as much as the selection."""
        hot, cold = hot_scores.numpy(), cold_scores.numpy()
        scored = hot.shape[1] + cold.shape[1]
        pooled = scored if pooled is None else pooled
        return cls.ranked(hot, cold, hot_positions, cold_positions, min(math.ceil(alpha * pooled), scored))

    @classmethod
    def ranked(cls, hot: np.ndarray, cold: np.ndarray, hot_positions: np.ndarray, cold_positions: np.ndarray,
               count: int) -> Picks:
        """The `count` best of hot [B, Nh] and cold [B, Nc] tokens per sequence by the ranks given (scores, or the
        top-p budget's estimated masses), positions as `top` takes them."""
        chosen = ops.top_share(hot, count=count, more=cold)
        hot_counts, padded_hot, positions, cold_chosen = ops.split_chosen(chosen, positions=hot_positions,
                                                                          more_positions=cold_positions)
        return cls(chosen, hot_counts, hot.shape[1], padded_hot, positions, cold_chosen)

    @property
    def hot_count(self) -> int:
        return int(self.hot_counts.sum())

    @property
    def cold_counts(self) -> np.ndarray:
        """How many cold tokens each sequence chose, [B]."""
        return self.chosen.shape[1] - self.hot_counts

    @property
    def cold_count(self) -> int:
        return self.chosen.size - self.hot_count

    def hot_slots(self) -> np.ndarray:
        """The chosen hot slots [B, the most any row chose], each row's own first (`hot_counts`), then slot 0: the split
        writes them in its pass over the choice, where deriving them from `chosen` in numpy cost a few calls a layer."""
        return np.ascontiguousarray(self.padded_hot[:, : int(self.hot_counts.max(initial=0))])

    def cold_rows(self, seq: int) -> np.ndarray:
        """Sequence `seq`'s chosen cold tokens, as indices among its scored cold tokens."""
        return self.chosen[seq, self.hot_counts[seq] :] - self.hot_used

    @cached_property
    def cold_positions(self) -> list[np.ndarray]:
        """Per sequence, the positions of the chosen cold tokens: the tail of its row."""
        return [row[count:] for row, count in zip(self.positions, self.hot_counts.tolist())]


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
    scored = hot_scores.shape[1] + cold_scores.shape[1]
    picked = cold_picks(hot_scores, cold_scores, min(math.ceil(alpha * scored), scored))
    return shortlist_for(cold_scores, picked, margin, least)


def cold_picks(hot: np.ndarray, cold: np.ndarray, count: int) -> np.ndarray:
    """How many cold tokens each sequence's best `count` of hot [B, Nh] and cold [B, Nc] ranks are, [B]."""
    return (ops.top_share(hot, count=count, more=cold) >= hot.shape[1]).sum(axis=1)


def shortlist_for(cold_scores: np.ndarray, picked: np.ndarray, margin: float, least: int) -> list[np.ndarray]:
    """Per sequence, its best cold slots (ascending) by sketch score (`cold_scores` [B, Nc]), `candidate_counts` of
    its cold picks `picked` [B] many."""
    counts = candidate_counts(margin, picked, cold_scores.shape[1], least)
    return [ops.top_share(row[None], count=int(count))[0] for row, count in zip(cold_scores, counts)]


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

    def source(self) -> ops.Source | None:
        """This segment as `ops.attend` takes a source (every row chosen), or None where it cannot."""
        if not self._compiled():
            return None
        return ops.Source(logits=self.logits.numpy(), values=_rows_buffer(self.values))

    def _compiled(self) -> bool:
        return (weighs_in_place(self.values, self.logits.shape[2]) and self.logits.dtype == torch.float32
                and self.logits.device.type == "cpu" and self.logits.is_contiguous())


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
        out = torch.empty(*weights.shape[:3], self.values.shape[3])
        ops.weighted_values(values=_rows_buffer(self.values), slots=self.slots, counts=self.counts,
                            weights=weights.numpy(), out=out.numpy(), start=start)
        return out

    def source(self) -> ops.Source:
        """The kernel reads these values already (`weighted`): no check needed."""
        return ops.Source(logits=self.logits.contiguous().numpy(), values=_rows_buffer(self.values), slots=self.slots,
                          counts=self.counts)


def _rows_buffer(rows: torch.Tensor) -> ops.Rows:
    """Rows [B, H, n, D] at any strides but the last as the compiled kernels take them: their whole buffer
    (bfloat16 as its bits), the first row's element offset in it, the strides of the first three dimensions, the
    shape."""
    elements = rows.untyped_storage().nbytes() // rows.element_size()
    storage = rows.as_strided((elements,), (1,), 0)
    storage = storage.view(torch.int16) if rows.dtype == torch.bfloat16 else storage
    return ops.Rows(storage.numpy(), rows.storage_offset(), rows.stride()[:3], rows.shape)


def weighs_in_place(values: torch.Tensor, group: int) -> bool:
    """Whether the compiled weighted sum (chosen_values.c) takes chosen values from `values` [B, Hkv, slots, D] for
    `group` query heads per KV head: `compiled_rows` holds, and the group's accumulators fit."""
    return compiled_rows(values) and group * values.shape[3] <= ops.MAX_ACCUMULATORS


def compiled_rows(rows: torch.Tensor) -> bool:
    """Whether the compiled kernels (chosen_values.c, candidate_dots.c) read `rows` [B, H, n, D] where they lie: in
    host memory, each row contiguous, float32 or bfloat16, head_dim a multiple of 8, a CPU with AVX2 and FMA."""
    return (ops.VECTORIZED and rows.device.type == "cpu" and rows.stride(3) == 1
            and rows.dtype in (torch.float32, torch.bfloat16) and rows.shape[3] % 8 == 0)


def _chosen_logits(dots: torch.Tensor, slots: np.ndarray, counts: np.ndarray) -> torch.Tensor:
    """The logits of each sequence's chosen `slots` [B, n] (its own the first counts[b], then padding) picked out of
    `dots` [B, Hkv, G, slots]; the padding's -inf."""
    logits = dots.gather(3, torch.from_numpy(slots)[:, None, None, :].expand(-1, *dots.shape[1:3], -1))
    if counts.min(initial=slots.shape[1]) == slots.shape[1]:
        return logits  # no padding (as at batch 1): a mask's few ops cost as much as the gather
    padding = torch.from_numpy(np.arange(slots.shape[1]) >= counts[:, None])
    return logits.masked_fill_(padding[:, None, None, :], float("-inf"))


def chosen_copied(dots: torch.Tensor, values: torch.Tensor, slots: np.ndarray, counts: np.ndarray,
                  positions: np.ndarray) -> Segment:
    """The chosen `slots` [B, n] (each sequence's own the first counts[b], then padding; positions [B, n]) of a
    source (logits `dots` [B, Hkv, G, slots], `values` [B, Hkv, slots, D]): their logits picked out (the padding's
    -inf), their values copied out."""
    rows = torch.from_numpy(slots)
    out = values.new_empty(len(rows), values.shape[1], rows.shape[1], values.shape[3])
    for seq in range(len(rows)):  # index_select per sequence: a batched gather of the rows was ~18x slower on the CPU
        torch.index_select(values[seq], 1, rows[seq], out=out[seq])
    return Segment(_chosen_logits(dots, slots, counts), out, positions)


def chosen_in_place(dots: torch.Tensor, values: torch.Tensor, slots: np.ndarray, counts: np.ndarray,
                    positions: np.ndarray) -> PooledSegment:
    """The chosen slots as `chosen_copied` gives them, but their values left where they lie (`weighs_in_place` must
    hold): the weighted sum reads them there."""
    return PooledSegment(_chosen_logits(dots, slots, counts), values, positions, slots, counts)


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
    D] (sequence s's own the first counts[s]; the rest padding, whatever it holds), and their importance [B, width];
    the padding's both -inf: never among the top, weighted 0. Where `compiled_rows` holds, one compiled pass
    (candidate_dots.c) reads the keys where they lie."""
    if compiled_rows(keys):
        batch, heads, group, _ = query.shape
        dots, token_importance = torch.empty(batch, heads, group, keys.shape[2]), torch.empty(batch, keys.shape[2])
        ops.candidate_dots(keys=_rows_buffer(keys), query=query.contiguous().numpy(),
                           counts=np.ascontiguousarray(counts, np.int64), out=dots.numpy(),
                           importance=token_importance.numpy(), aggregation=aggregation)
        return dots, token_importance
    # the keys copied out of the records first: torch's product over their strides took twice as long at batch 8;
    # numpy's product, faster still, runs OpenBLAS threads that take the scorer's core
    dots = torch.matmul(query, keys.float().contiguous().transpose(2, 3))
    padding = torch.from_numpy(np.arange(keys.shape[2]) >= counts[:, None])
    token_importance = importance(dots, aggregation).masked_fill_(padding, float("-inf"))
    return dots.masked_fill_(padding[:, None, None, :], float("-inf")), token_importance


def window_segment(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: np.ndarray) -> Segment:
    """The device window (sink + recent + new token) as a segment; query float32 [B, Hkv, G, D] on its device. In one
    compiled pass where `compiled_rows` holds (candidate_dots.c), reading the keys where they lie."""
    if compiled_rows(keys):
        logits, _ = candidate_scores(query, keys, np.full(len(query), keys.shape[2], dtype=np.int64), "sum")
    else:
        logits = torch.matmul(query, keys.float().transpose(2, 3))  # [B, Hkv, G, W]
    return Segment(logits, values, np.broadcast_to(positions, (len(query), len(positions))))


def exact_attention(segments: list[Segment], query: torch.Tensor, scaling: float,
                    attention_mask: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """One softmax over the segments' tokens together; the output [B, 1, Hq, D] in the query's dtype (the layout
    transformers' attention functions return).

    `attention_mask`: the model's decode mask (boolean keep or additive, over all positions) or None. The device
    window holds the new token, never masked, so every row's peak is finite; the in-place steps below rely on it
    (each op on a [B, Hkv, G, tokens] tensor is a pass over it, and this runs once per layer and step). Without a
    mask or softcap, where the kernel reads every segment where it lies, it is one compiled call instead
    (chosen_values.attend): a dozen small ops' dispatch cost more than their arithmetic.
    """
    segments = [segment for segment in segments if segment.width]
    sources = None if attention_mask is not None or softcap else compiled_sources(segments)
    if sources is not None:
        return _attended(sources, query, segments[0].logits.shape, scaling)
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


def compiled_sources(segments: list[Segment]) -> tuple | None:
    """The segments as `ops.attend` takes them, or None where the kernel cannot read one of them."""
    sources = tuple(segment.source() for segment in segments)
    return None if None in sources else sources


def _attended(sources: tuple, query: torch.Tensor, shape: torch.Size, scaling: float) -> torch.Tensor:
    """exact_attention in one compiled call (chosen_values.c) over the sources, logits of `shape` [B, Hkv, G, n]."""
    batch, heads, group, _ = shape
    head_dim = query.shape[-1]
    out = torch.empty(batch, heads, group, head_dim)
    ops.attend(sources=sources, out=out.numpy(), scaling=scaling)
    return out.view(batch, heads * group, head_dim)[:, None].to(query.dtype)
