"""Lookahead: the next layer's cold candidates are scored and read while this layer computes.

Consecutive layers' attention inputs are similar (InfiniGen's observation), so
layer l+1's decode query is predicted from the hidden state entering layer l:
q' = rope(Wq[l+1] norm[l+1](h_l)). As layer l starts attending (before it
takes its own candidates), it sends q' to the storage scorer, which scores
layer l+1's cold pool with it once it is done with layer l's request (or
while layer l's candidate reads are on the disk), then reads layer l+1's top
candidates' full-precision K/V and checks them (candidate_reads.py), all
while layer l computes. By the time layer l+1 attends they are usually
waiting in shared memory: neither the scoring nor the cold reads sit on the
host's critical path, nor on its core.

A layer whose candidates came late (its step waited for them) is asked for
one layer earlier from then on, up to three layers ahead, its query then
predicted from that earlier layer's input (`Lookahead.ahead`): the
scorer's and the disk's time per layer is uneven, a few layers read far more
candidates than the rest, and an earlier request spreads their reads over
the layers before them.

The prediction only chooses *candidates*, per sequence `margin` x the cold
tokens it chose in the layer last step (selection.candidate_counts): layer
l+1 scores them with its true query on their full-precision keys, and its
top-alpha over hot pool and candidates is exact for every token it considers,
as an unpredicted layer's over its shortlist (selection.py). A cold token the
prediction ranks below the candidates is missed (`kvtier bench sparse`'s
recall table measures how often).

Only layers that directly follow a tiered layer are predicted (Gemma 3's full
layers are five sliding layers apart), not the first `skip` tiered layers,
whose inputs change most from layer to layer, and not layers whose cold pool
is under `min_cold` tokens per sequence: there the prediction and the choice
among candidates cost about what they hide.

The first `skip` tiered layers are asked for a step ahead instead: as the last
tiered layer starts attending, the scorer is sent their queries of the step
now ending, and it reads their candidates while the model finishes the step
and begins the next (the hit table's observation: what a layer chose at one
step it mostly chooses at the next). A step that begins with anything else in
flight (the one before ended midway) drops it all (`open_step`).
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np
import torch

from kvtier.errors import StorageError
from kvtier.kernels import ops
from kvtier.sparse.cold.cold_pool import Fetched
from kvtier.sparse.selection import MIN_CANDIDATES, candidate_counts
from kvtier.sparse.stats import PhaseClock


class QueryForecast:
    """Captures each decoder layer's input hidden state and predicts the next layer's decode query from it."""

    def __init__(self, model, kv_heads: int, summed: bool) -> None:
        """`summed`: predict what the "sum" aggregation scores with, each KV head's group of queries summed."""
        self.decoders = list(model.get_decoder().layers)
        self.kv_heads, self.summed = kv_heads, summed
        self.hidden: torch.Tensor | None = None
        self.rotary: tuple[torch.Tensor, torch.Tensor] | None = None
        # The captured token of each sequence: the last one of a [B, T] forward; in the serving engine's packed
        # [1, N] forward, where this cache's sequence sits (the engine sets it before the forward).
        self.row = -1
        self._folded_projections: dict[int, FoldedProjection | None] = {}
        self._rotation: torch.Tensor | None = None  # the step's rotary as the folded query takes it
        self._rotation_of: tuple[torch.Tensor, torch.Tensor] | None = None  # the rotary it was made from
        self._hooks = [decoder.register_forward_pre_hook(self._capture, with_kwargs=True) for decoder in self.decoders]

    def _capture(self, _module, args, kwargs) -> None:
        self.hidden = args[0] if args else kwargs["hidden_states"]
        self.rotary = kwargs.get("position_embeddings")

    def score_query(self, layer_idx: int) -> np.ndarray:
        """What the scorer scores layer `layer_idx` with, float32 [B, Hkv, Q, D] (SparseRuntime.score_query's
        form), predicted from the last captured hidden state."""
        folded = self._folded(layer_idx) if self.summed else None
        if folded is not None:
            return folded.summed_query(self.hidden.select(1, self.row), self._float_rotation())
        with torch.no_grad():
            query = self.predict(layer_idx).float()
            grouped = query.view(len(query), self.kv_heads, -1, query.shape[-1])
            summed = grouped.sum(dim=2, keepdim=True) if self.summed else grouped
            return summed.cpu().numpy()  # made where the model lies

    def predict(self, layer_idx: int) -> torch.Tensor:
        """Layer `layer_idx`'s decode query [B, Hq, 1, D], predicted from the last captured hidden state."""
        attention = self.decoders[layer_idx].self_attn
        with torch.no_grad():
            hidden = self._normed(layer_idx)
            query = attention.q_proj(hidden).view(len(hidden), -1, 1, attention.head_dim)
            if hasattr(attention, "q_norm"):
                query = attention.q_norm(query)
            return self._rotated(query)

    def _normed(self, layer_idx: int) -> torch.Tensor:
        return self.decoders[layer_idx].input_layernorm(self.hidden[:, self.row])

    def _rotated(self, query: torch.Tensor) -> torch.Tensor:
        """transformers' rotary embedding (apply_rotary_pos_emb) of a query [B, H, 1, D] at the current position."""
        cos, sin = (part[:, None, self.row].unsqueeze(2) for part in self.rotary)
        return query * cos + _rotated_half(query) * sin

    def _float_rotation(self) -> torch.Tensor:
        """The step's rotary at the current position as FoldedProjection.summed_query takes it, made once per step."""
        if self._rotation_of is not self.rotary:
            cos, sin = (part[:, self.row].unsqueeze(1).float() for part in self.rotary)
            half = sin.shape[-1] // 2
            signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
            self._rotation = torch.stack([cos, signed_sin], dim=1)[:, :, None]
            self._rotation_of = self.rotary
        return self._rotation

    def prepare(self, layer_indices: list[int]) -> None:
        """Fold the projections of the layers to be predicted now, not in the decode step that first predicts them
        (a few hundred microseconds a layer)."""
        if self.summed:
            for layer_idx in layer_indices:
                self._folded(layer_idx)

    def _folded(self, layer_idx: int) -> FoldedProjection | None:
        if layer_idx not in self._folded_projections:
            decoder = self.decoders[layer_idx]
            with torch.no_grad():
                self._folded_projections[layer_idx] = FoldedProjection.of(decoder.input_layernorm, decoder.self_attn,
                                                                           self.kv_heads)
        return self._folded_projections[layer_idx]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._folded_projections = {}


@dataclass
class FoldedProjection:
    """One layer's summed query, predicted in one product: the rows of each KV head's group of query projections
    summed (rotation is linear and the same for every head, so this gives the sum of the rotated queries at a G-th of
    the cost) and the input norm's gain folded into them, float32. The model's own path is a dozen small ops per layer
    and step, where this is a handful."""

    weight: torch.Tensor  # [Hkv * D, hidden]
    bias: torch.Tensor | None
    epsilon: float
    kv_heads: int

    @classmethod
    def of(cls, norm, attention, kv_heads: int) -> FoldedProjection | None:
        """The folded form of `attention`'s query after `norm`, or None where it does not reproduce them: a
        norm that is not weight x RMS-normalized input (Gemma's 1 + weight), or a query norm after the projection."""
        epsilon = getattr(norm, "variance_epsilon", None)
        if hasattr(attention, "q_norm") or epsilon is None or getattr(norm, "weight", None) is None:
            return None
        projection, head_dim = attention.q_proj, attention.head_dim
        summed = projection.weight.float().view(kv_heads, -1, head_dim, projection.in_features).sum(dim=1)
        bias = None if projection.bias is None else projection.bias.float().view(kv_heads, -1, head_dim).sum(dim=1)
        folded = cls((summed * norm.weight.float()).reshape(-1, projection.in_features),
                     None if bias is None else bias.reshape(-1), float(epsilon), kv_heads)
        return folded if folded._matches(norm) else None

    def summed_query(self, hidden: torch.Tensor, rotation: torch.Tensor) -> np.ndarray:
        """[B, Hkv, 1, D] float32 from the hidden state [B, hidden] and the step's rotary as float32 [B or 1, 2, 1, 1,
        D] (cos, and sin with its first half negated): q x cos + rotate_half(q) x sin, rotate_half(q) being q with its
        halves swapped and the first negated. On an x86-64 CPU one compiled call (summed_query.c), else torch's ops."""
        if ops.VECTORIZED and self.weight.device.type == "cpu":
            return self._compiled(hidden, rotation)
        normed = torch.nn.functional.rms_norm(hidden.float(), hidden.shape[-1:], eps=self.epsilon)
        query = torch.nn.functional.linear(normed, self.weight, self.bias).view(len(hidden), self.kv_heads, 1, -1)
        rotated = torch.addcmul(query * rotation[:, 0], query.roll(query.shape[-1] // 2, dims=-1), rotation[:, 1])
        return rotated.detach().cpu().numpy()  # computed where the model lies (a GPU's weights stay there)

    def _compiled(self, hidden: torch.Tensor, rotation: torch.Tensor) -> np.ndarray:
        batch, head_dim = len(hidden), rotation.shape[-1]
        query = np.empty((batch, self.kv_heads, 1, head_dim), dtype=np.float32)
        weight, bias = self._arrays
        ops.summed_query(hidden=hidden.detach().float().contiguous().numpy(), weight=weight, bias=bias,
                         rotation=rotation.contiguous().numpy().reshape(-1, 2, head_dim),
                         out=query.reshape(batch, self.kv_heads, head_dim), epsilon=self.epsilon)
        return query

    @cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The weight and bias as the compiled call takes them, made once."""
        return self.weight.numpy(), None if self.bias is None else self.bias.numpy()

    def _matches(self, norm) -> bool:
        """Whether `norm` is weight x the RMS-normalized input, what the fold assumes (checked on one probe)."""
        probe = torch.randn(2, norm.weight.shape[0], generator=torch.Generator().manual_seed(0)).to(norm.weight.device)
        ours = norm.weight.float() * torch.nn.functional.rms_norm(probe, probe.shape[-1:], eps=self.epsilon)
        theirs = norm(probe.to(norm.weight.dtype)).float()
        return torch.allclose(theirs, ours, rtol=2e-2, atol=1e-3)


def _rotated_half(query: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: [-second half, first half] of the last dimension."""
    first, second = query.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


LATE_WAIT_S = 0.002  # a layer that waits longer for its candidates is asked for a layer earlier from then on
MAX_AHEAD = 3  # the farthest ahead a layer is asked for: the scorer holds this many requests besides the attending one


class TieredLayer(Protocol):
    """What the lookahead reads of a tiered layer (SparseLayer) to ask for its candidates."""

    tier: int  # its index among the tiered layers (its cold-pool region)
    layer_idx: int  # its index among the model's layers
    cold_picked: np.ndarray | None  # the cold tokens each sequence chose at its last step [B]; None before the first

    def candidates_needed(self, cold_tokens: int) -> int:
        """Candidates a sequence needs for the hot pool and them to hold the top-alpha share of the whole pool."""


class Lookahead:
    """The schedule of the layers ahead: which tiered layers' candidates the scorer is asked for, when and with which
    query, and those requests while the scorer scores them and reads their candidates, in order. Layer l + 1's request
    goes out as layer l starts attending, while the scorer may still read layer l's.

    Per step a layer takes its candidates (`candidates_for`), which sends the next layers' requests first when its own
    are in flight; a layer that reads its own sends them once its reads are queued (`ask_ahead`); a layer asked for a
    step ahead keeps the query it scored with (`keep_query`)."""

    def __init__(self, forecast: QueryForecast, margin: float, skip: int, min_cold: int, scorer, cold) -> None:
        self.forecast = forecast
        self.margin, self.skip, self.min_cold = margin, skip, min_cold
        self.scorer, self.cold = scorer, cold
        self._tiers: deque[int] = deque()  # the layers ahead, oldest first, while the scorer works on them
        self._for_next_step: list[int] = []  # those asked for at the end of a step, for the next
        self._layers: list[TieredLayer] = []  # the tiered layers, tier i at index i (`chain`)
        self._first: list[TieredLayer] = []  # the first `skip` of them: asked for a step ahead
        self._step_queries: list[np.ndarray | None] = []  # what each of those scored with at the step now ending
        self.ahead: list[int] = []  # per tier: how many layers before it its candidates are asked for

    def chain(self, layers: list[TieredLayer]) -> None:
        """The model's tiered layers in order (tier i at index i). Folds the query projections of the layers it will
        predict now, not in the decode step that first predicts them (a few hundred microseconds a layer)."""
        self._layers, self._first = layers, layers[: self.skip]
        self._step_queries = [None] * len(self._first)
        self.ahead = [1] * len(layers)
        self.forecast.prepare([layer.layer_idx for before, layer in zip(layers, layers[1:])
                               if is_predicted(layer.tier, before.layer_idx, layer.layer_idx, self.skip)])

    @property
    def in_flight(self) -> tuple[int, ...]:
        """The tiers whose candidates are being scored or read, oldest first."""
        return tuple(self._tiers)

    def candidates_for(self, layer: TieredLayer, clock: PhaseClock) -> Fetched | None:
        """`layer`'s candidates read ahead (waiting for them if need be), or None where none were asked for: the layer
        then reads its own. While its own are in flight, the next layers' requests are sent first, queued behind them
        (phase "look ahead"); then the wait for them ("take"). A predicted layer that waited longer than LATE_WAIT_S is
        asked for one layer earlier from the next step on, up to MAX_AHEAD."""
        tier = layer.tier
        if self._tiers and self._tiers[0] == tier:
            self.ask_ahead(layer)
        clock.lap("look ahead")
        candidates = self.take(tier)
        clock.lap("take")
        if candidates is not None and tier >= self.skip and clock.seconds["take"] > LATE_WAIT_S:
            self.ahead[tier] = min(self.ahead[tier] + 1, MAX_AHEAD)
        return candidates

    def asks_a_step_ahead(self, tier: int) -> bool:
        """Whether tier `tier`'s candidates are asked for a step ahead, with the query it scores with at this step."""
        return tier < self.skip

    def keep_query(self, tier: int, query: np.ndarray) -> None:
        """What tier `tier` (`asks_a_step_ahead`) scored with at this step, float32 [B, Hkv, Q, D]: its candidates for
        the next step are asked for with it."""
        self._step_queries[tier] = query

    def ask_ahead(self, layer: TieredLayer) -> None:
        """Start scoring and reading the cold candidates of the tiered layers after `layer` with their predicted
        queries: the next one, and those up to the farthest within MAX_AHEAD that asks to be predicted that far
        (`ahead`), so that the requests stay in layer order. After the last tiered layer, the first ones' for the next
        step. A layer is predicted if it follows the one before it directly, its cold pool is large enough and it
        chose cold tokens before (that count sizes its candidates)."""
        following = self._layers[layer.tier + 1 : layer.tier + 1 + MAX_AHEAD]
        if not following:
            self._ask_for_next_step()
            return
        farthest = max([1] + [distance for distance, target in enumerate(following, start=1)
                              if self.ahead[target.tier] >= distance])
        before = layer
        for target in following[:farthest]:
            if not self._predict(target, before):
                return
            before = target

    def _predict(self, target: TieredLayer, before: TieredLayer) -> bool:
        """Ask for `target`'s candidates (directly after `before`) under the query predicted from the last captured
        hidden state; whether they are in flight."""
        if target.tier not in self._tiers and not is_predicted(target.tier, before.layer_idx, target.layer_idx,
                                                               self.skip):
            return False
        return self._ask_for(target, lambda: self.forecast.score_query(target.layer_idx))

    def _ask_for_next_step(self) -> None:
        """Start scoring and reading the first tiered layers' candidates for the next step with the queries they
        attended with at this one (those layers are not predicted from a layer before them); in layer order."""
        for target in self._first:
            if not self._ask_for(target, lambda tier=target.tier: self._step_queries[tier], next_step=True):
                return

    def _ask_for(self, target: TieredLayer, query: Callable[[], np.ndarray], next_step: bool = False) -> bool:
        """Ask the scorer for `target`'s candidates under `query()` unless they are in flight; whether they are. Not
        for a layer that has chosen no cold tokens yet (its last picks size the candidates: `margin` x them, at least
        MIN_CANDIDATES and what it needs) or whose cold pool is under `min_cold` tokens: it is not worth it."""
        if target.tier in self._tiers:
            return True
        if target.cold_picked is None:
            return False
        self.cold.settle(target.tier)
        cold_tokens = int(self.cold.used[target.tier])
        if cold_tokens < self.min_cold:
            return False
        counts = candidate_counts(self.margin, target.cold_picked, cold_tokens, target.candidates_needed(cold_tokens))
        counts = np.minimum(counts, self.scorer.channel.spec.candidates)  # past a guard's lifted ceiling: the room
        self.start(target.tier, query(), cold_tokens, counts, next_step)
        return True

    def start(self, tier: int, predicted: np.ndarray, cold_tokens: int, counts: np.ndarray,
              next_step: bool = False) -> None:
        """Ask the scorer for tier `tier`'s best `counts` candidates under the predicted query, after the requests it
        has in hand; the layer's writes must be settled. `next_step`: asked for the next decode step."""
        self.scorer.request(tier, predicted, cold_tokens, counts)
        self._tiers.append(tier)
        if next_step:
            self._for_next_step.append(tier)

    def open_step(self) -> None:
        """A decode step begins: keep what the step before asked for it if nothing else is in flight (else the step
        before failed midway), drop the rest."""
        if list(self._tiers) != self._for_next_step:
            self.drain()
        self._for_next_step = []

    def take(self, tier: int) -> Fetched | None:
        """The candidates read ahead for `tier` (waiting for them if need be), or None when none were started for it."""
        if not self._tiers or self._tiers[0] != tier:
            self.drain()
            return None
        self._tiers.popleft()
        slots, records, nbytes = self.scorer.candidates()
        return self.cold.fetched(slots, records, int(nbytes.sum()))

    def drain(self) -> None:
        """Finish what is in flight and drop it (a step that ended midway): the scorer is free."""
        while self._tiers:
            self._drop_oldest()
        self._for_next_step = []

    def _drop_oldest(self) -> None:
        self._tiers.popleft()
        self.scorer.candidates()

    def close(self) -> None:
        """Finish what is in flight (the scorer must not still read when the pool closes) and let go of the model's
        layers. A request no step will take whose reads fail (a damaged page: the cache is closed for it, as a
        sequence whose step met the damage is) raises nothing here, and the rest are still finished."""
        try:
            while self._tiers:
                with contextlib.suppress(StorageError):
                    self._drop_oldest()
        finally:
            self.forecast.close()


def candidate_capacity(share: float, margin: float, max_tokens: int) -> int:
    """The most candidates the lookahead asks for per sequence (selection.candidate_counts) in a pool of up to
    `max_tokens` tokens: a layer picks at most ceil(share x pooled) cold tokens (`share`: alpha, or the top-p
    budget's ceiling; past it, where the guard lifted the ceiling, the ask is cut to this room), and needs at most
    that many candidates."""
    return min(max_tokens, max(MIN_CANDIDATES, math.ceil(margin * math.ceil(share * max_tokens))))


def is_predicted(next_tier: int, layer_idx: int, next_layer_idx: int, skip: int) -> bool:
    """Whether tier `next_tier` (model layer `next_layer_idx`) is predicted from layer `layer_idx`'s input."""
    return next_layer_idx == layer_idx + 1 and next_tier >= skip
