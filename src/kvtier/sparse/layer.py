"""One full-attention layer of the sparse cache: device window, hot pool, cold pool, selection and exact attention.

Life of a layer:

1. Prefill (query longer than one token): K/V accumulate densely and
   attention is the model's own, exact; the attention function hands the
   layer the last prompt queries (the observation window).
2. First decode step: `distribute()` keeps the sink and recent tokens on the
   device and splits the rest between the hot pool (DRAM) and the cold pool
   (files) by the observation window's selection scores (placement.py), sized
   by APP.
3. Every decode step (`attend`): the query goes to the storage scorer (cold
   pool) and scores the hot pool meanwhile (the window's logits are built
   then too); the sketch scores draw up a shortlist of cold tokens, read in
   full precision from the K/V file, and the top-alpha of hot pool and
   shortlist by exact q.k is attended (selection.py), one softmax over all.
   At alpha = 1 every token is attended, so the output equals a dense cache
   up to float rounding. With lookahead (lookahead.py) the storage scorer
   drew up the shortlist with a predicted query and read it while the
   previous layer computed (the layer sends the next layer's predicted query
   before it takes its own candidates); the first layers' were asked for at
   the end of the step before, with the queries they attended with there.
   The hit table records the step and the migration policy plans its swaps
   once the choice is made.
4. After attention, off the critical path: the migration policy swaps a
   bounded number of cold and hot tokens, and tokens leaving the recent
   window enter the hot pool `retire_batch` at a time; when it overflows by
   `demote_batch` tokens, the coldest are demoted together. Their disk writes
   run on the cold pool's writer thread while the next layers compute; the
   layer's next step waits for them before it reads the cold pool.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.kv.gather import take_tokens
from kvtier.kv.windowed import WindowedLayer
from kvtier.sparse.cold.cold_image import ImagedLayer
from kvtier.sparse.cold.cold_pool import Fetched
from kvtier.sparse.hot.hit_table import HitTable
from kvtier.sparse.hot.hot_pool import HotPool
from kvtier.sparse.hot.migration import NO_SWAPS, HitPolicy, PingPongMeter, Swaps
from kvtier.sparse.hot.initial_placement import seed_hits, selection_importance, split_hot_cold
from kvtier.sparse.selection import (
    Picks, Segment, candidate_scores, candidates_in_place, chosen_copied, chosen_in_place, exact_attention, shortlist,
    weighs_in_place, window_segment,
)
from kvtier.sparse.stats import PhaseClock

if TYPE_CHECKING:
    from kvtier.sparse.runtime import SparseRuntime

LATE_WAIT_S = 0.002  # a layer that waits longer for its candidates is asked for a layer earlier from then on
MAX_AHEAD = 3


class SparseLayer(WindowedLayer):
    """KV of one full-attention layer, tiered across device window, hot pool and cold pool."""

    def __init__(self, layer_idx: int, tier: int, runtime: SparseRuntime) -> None:
        settings = runtime.settings
        super().__init__(layer_idx, runtime.max_tokens, settings.sink, settings.recent, settings.retire_batch)
        self.tier = tier  # index among the tiered layers (cold-pool region)
        self.runtime = runtime
        self.hot: HotPool | None = None
        self.table: HitTable | None = None
        self.meter = PingPongMeter()
        self._observation: torch.Tensor | None = None
        self.next_tiered: SparseLayer | None = None  # the next tiered layer of the model (lookahead.py)
        self.next_step: list[SparseLayer] = []  # on the last tiered layer: those asked for the next step's candidates
        self.own_query: np.ndarray | None = None  # what such a layer scored with this step (lookahead.py)
        self.cold_picked: np.ndarray | None = None  # cold tokens each sequence chose at the last step
        self.ahead = 1  # how many layers before it its candidates are asked for (lookahead.py)

    def make_pool(self, batch: int, heads: int, head_dim: int) -> None:
        self.hot = HotPool(batch, heads, head_dim, self.dtype, pin=self.device.type == "cuda")
        self.table = HitTable(batch, self.runtime.max_tokens)

    def pool_tokens(self) -> tuple[int, int]:
        self.runtime.cold.settle(self.tier)
        return self.hot.used, int(self.runtime.cold.used[self.tier])

    # ----- prefill -----

    def observe(self, query: torch.Tensor, _scaling: float) -> None:
        """Keep the last `observation_window` prompt queries [B, Hq, w, D] for placement (which ranks by raw q.k, as
        the decode step's selection does: the attention scaling does not change the order)."""
        window = self.runtime.settings.observation_window
        recent = query if self._observation is None else torch.cat([self._observation, query], dim=2)
        self._observation = recent[:, :, -window:].clone()

    def place(self, pool: slice) -> None:
        """Split the prompt's middle between hot pool and cold pool by observation-window importance (APP's sizes).
        With a stored image, the positions it covers are placed as it placed them, and only the rest is split."""
        image = self.runtime.image
        if image is not None:
            imaged = min(image.tokens, pool.stop)
            self._restore(image.layers[self.tier], imaged)
            rest = slice(imaged, pool.stop)
            if rest.stop - rest.start <= self.runtime.hot_tokens - self.hot.used:
                # a question's few tokens: ranking them would score the window on every key
                self.admit(self.keys[:, :, rest], self.values[:, :, rest], np.arange(rest.start, rest.stop))
            else:
                self._split(rest)
        elif pool.stop > pool.start:
            self._split(pool)
        self._observation = None

    def _split(self, pool: slice) -> None:
        """Place the pool's tokens hot or cold by observation-window importance, within the hot pool's room."""
        importance = self._importance()[:, pool].cpu().numpy()  # computed where the prompt's K/V lie
        hot_count = min(self.runtime.hot_tokens_for(importance), self.runtime.hot_tokens - self.hot.used)
        hot_index, cold_index = split_hot_cold(importance, hot_count)
        pool_keys, pool_values = self.keys[:, :, pool].cpu(), self.values[:, :, pool].cpu()
        self._reserve_hot()
        self.hot.append(take_tokens(pool_keys, hot_index), take_tokens(pool_values, hot_index), hot_index + pool.start)
        if cold_index.shape[1]:
            self.runtime.cold.append(self.tier, take_tokens(pool_keys, cold_index), take_tokens(pool_values, cold_index),
                                     cold_index + pool.start)
        positions = np.arange(pool.start, pool.stop)[None, :].repeat(len(importance), axis=0)
        self.table.seed(positions, seed_hits(importance, self.runtime.settings.alpha))

    def _restore(self, stored: ImagedLayer, imaged: int) -> None:
        """Place positions [sink, imaged) as `stored` placed them: its cold slots are adopted where they lie (nothing
        is written), its hot positions are taken from the prompt's K/V, its hit table is restored."""
        hot_positions = stored.hot[stored.hot < imaged][None, :]
        index = torch.from_numpy(hot_positions[0])
        self._reserve_hot()
        self.hot.append(self.keys[:, :, index].cpu(), self.values[:, :, index].cpu(), hot_positions)
        self.runtime.cold.adopt(self.tier, stored.cold[: np.searchsorted(stored.cold, imaged)])
        self.table.restore(stored.hits[:imaged], stored.idle[:imaged])

    def _reserve_hot(self) -> None:
        """Room in the hot pool, before its first tokens, for the most it holds (planned + a demotion batch + a
        retirement batch): growing it later would copy the pool, in a decode step at the first retirement."""
        settings = self.runtime.settings
        self.hot.reserve(self.runtime.hot_tokens + settings.demote_batch + settings.retire_batch)

    def _importance(self) -> torch.Tensor:
        if self._observation is None:  # a prompt fed token by token: no window, keep newer tokens hot
            return torch.arange(self.tokens, dtype=torch.float32)[None, :].repeat(self.keys.shape[0], 1)
        return selection_importance(self._observation, self.keys, self.runtime.settings.aggregation)

    # ----- decode -----

    def admit(self, keys: torch.Tensor, values: torch.Tensor, positions: np.ndarray) -> None:
        """Tokens leaving the recent window enter the hot pool; demote in a batch if it overflows."""
        positions = np.broadcast_to(positions, (keys.shape[0], len(positions))).copy()
        self.hot.append(keys.to("cpu"), values.to("cpu"), positions)
        self.table.seed(positions, np.ones_like(positions, dtype=np.uint8))
        overflow = self.hot.used - self.runtime.hot_tokens
        if overflow >= self.runtime.settings.demote_batch:
            self._demote(overflow)

    def _demote(self, count: int) -> None:
        policy = self.runtime.policy or HitPolicy()
        victims = policy.overflow_victims(self.table, self.hot.positions[:, : self.hot.used], count)
        keys, values, positions = self.hot.take(victims)
        self.runtime.cold.append_later(self.tier, keys, values, positions, self._background_timer())
        for seq in range(len(positions)):
            self.meter.record(self.table.steps, seq, positions[seq], -1)
        step = self.runtime.stats.current
        if step is not None:
            step.demotions += positions.size

    def _background_timer(self) -> Callable[[float], None] | None:
        """What adds a background write's duration to the current step's stats (off its critical path)."""
        step = self.runtime.stats.current
        if step is None:
            return None

        def add(seconds: float) -> None:
            step.background_write_s += seconds

        return add

    def _swap_timer(self, swaps: int) -> Callable[[float], None]:
        """What a swap batch's write time goes to: the step's stats and the promotion price."""
        to_stats, price = self._background_timer(), self.runtime.promotion_price

        def add(seconds: float) -> None:
            price.observe_writes(seconds, swaps)
            if to_stats is not None:
                to_stats(seconds)

        return add

    def attend(self, module, query: torch.Tensor, attention_mask: torch.Tensor | None,
               inner: Callable, **kwargs) -> tuple[torch.Tensor, None]:
        """Exact attention of the decode query [B, Hq, 1, D] over sink + top-alpha pooled + recent tokens.

        Overlapped, not in sequence: the host scores its hot pool and builds the window's logits while the
        storage scorer draws up the cold shortlist; the layer then scores the shortlist with its own query and
        chooses among hot pool and shortlist at once. With lookahead (lookahead.py) the scorer drew up the
        shortlist with a predicted query and read it while the previous layer computed (the candidates); else
        the host draws it up from the scorer's scores and reads it. `inner` (the model's own attention) is not
        needed: the hot scores are the logits.
        """
        if self.device.type == "cuda":  # the model's queued kernels finish here, not in this layer's first phase
            torch.cuda.synchronize(self.device)
        runtime, step, clock = self.runtime, self.runtime.stats.current, PhaseClock()
        lookahead = runtime.lookahead
        if lookahead is not None and lookahead.in_flight[:1] == (self.tier,):
            self._look_ahead()  # the next layers' predicted queries, queued behind this layer's candidates
        clock.lap("look ahead")
        candidates = lookahead.take(self.tier) if lookahead is not None else None
        clock.lap("take")
        prefetched = candidates is not None
        if prefetched and not self.asked_a_step_ahead and clock.seconds["take"] > LATE_WAIT_S:
            self.ahead = min(self.ahead + 1, MAX_AHEAD)  # late: asked for one layer earlier from the next step on
        if not prefetched:
            runtime.cold.settle(self.tier)  # last step's moves of this layer: normally on disk long since
        clock.lap("settle")
        cold_count = int(runtime.cold.used[self.tier])
        grouped = runtime.grouped_query(query)
        if self.asked_a_step_ahead or (not prefetched and cold_count):
            own_query = runtime.score_query(grouped).numpy()
            if self.asked_a_step_ahead:
                self.own_query = own_query
            if not prefetched and cold_count:
                runtime.scorer.request(self.tier, own_query, cold_count)
        hot_dots, hot_scores = self.hot.scores(grouped, runtime.settings.aggregation)
        clock.lap("hot scores")
        window = window_segment(grouped.to(self.device), self.keys, self.values, self.window_positions)
        clock.lap("window")
        if not prefetched:  # the wait for the scorer's answer is scoring
            cold_scores = runtime.scorer.scores() if cold_count else np.empty((len(query), 0), dtype=np.float32)
            clock.lap("cold scores")
            slots = shortlist(hot_scores.numpy(), cold_scores, runtime.settings.alpha,
                              runtime.settings.candidate_margin, self.candidates_needed(cold_count))
            clock.lap("choice")
            wait_cold = runtime.cold.submit_fetch(self.tier, slots)
            self._look_ahead()  # after this layer's reads are queued: they go first
            clock.lap("submit")
            candidates = wait_cold()
            clock.lap("cold reads")
        picks, cold_scores, cold_segment = self._pick_among(candidates, grouped, hot_scores, cold_count)
        clock.lap("choice")
        swaps = self._plan_swaps(picks, hot_scores.numpy(), cold_scores.numpy())
        clock.lap("plan")
        hot = self._hot_segment(hot_dots, picks)
        clock.lap("hot segment")
        scaling = kwargs.get("scaling")
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        output = exact_attention([window, hot, cold_segment], query, scaling, attention_mask, kwargs.get("softcap"))
        clock.lap("softmax")
        fetch = clock.part("fetch_s")
        runtime.promotion_price.observe_fetch(fetch, picks.cold_count)
        if runtime.on_attend is not None:
            self._report_attended(picks.positions)
        self._apply_swaps(swaps, picks, candidates)
        self.cold_picked = picks.cold_counts
        self.retire()
        clock.lap("after")
        if step is not None:
            clock.charge(step)
            step.unpredicted_fetch_s += 0.0 if prefetched else fetch
            phases = clock.seconds
            step.host_time_s += phases["hot scores"]
            scorer_round_trip = phases["hot scores"] + phases["window"] + phases["cold scores"] if cold_count else 0.0
            step.storage_time_s += scorer_round_trip + phases["cold reads"]
            step.selected_hot += picks.hot_count
            step.selected_cold += picks.cold_count
            step.pooled_hot += self.hot.used * len(query)
            step.pooled_cold += cold_count * len(query)
            step.cold_bytes_fetched += candidates.nbytes
            step.lookahead_layers += prefetched
        return output, None

    def _look_ahead(self) -> None:
        """Start scoring and reading the next tiered layers' cold candidates with their predicted queries: the next
        one, and those up to the farthest layer within MAX_AHEAD that asks to be predicted that far (`ahead`), so
        that the requests stay in layer order. A layer is predicted if it follows its predecessor directly, its cold
        pool is large enough and it chose cold tokens before (its count sizes the candidates)."""
        if self.runtime.lookahead is None:
            return
        if self.next_tiered is None:
            self._ask_for_next_step()
            return
        chain, layer = [], self.next_tiered
        while layer is not None and len(chain) < MAX_AHEAD:
            chain.append(layer)
            layer = layer.next_tiered
        farthest = max([1] + [distance for distance, layer in enumerate(chain, start=1) if layer.ahead >= distance])
        before = self
        for target in chain[:farthest]:
            if not self._predict(target, before):
                return
            before = target

    def _predict(self, target: SparseLayer, before: SparseLayer) -> bool:
        """Ask for `target`'s candidates (directly after `before`) from the last captured hidden state; whether they
        are in flight."""
        lookahead = self.runtime.lookahead
        if target.tier not in lookahead.in_flight and not lookahead.wants(target.tier, before.layer_idx,
                                                                          target.layer_idx):
            return False
        return self._ask_for(target, lambda: lookahead.forecast.score_query(target.layer_idx))

    @property
    def asked_a_step_ahead(self) -> bool:
        """Whether the lookahead asks for this layer's candidates a step ahead, with its own query of this step."""
        return self.runtime.lookahead is not None and self.tier < self.runtime.lookahead.skip

    def _ask_for_next_step(self) -> None:
        """Start scoring and reading the first tiered layers' candidates for the next step with the queries they
        attended with at this one (those layers are not predicted from a layer before them); in layer order."""
        for target in self.next_step:
            if not self._ask_for(target, lambda target=target: target.own_query, next_step=True):
                return

    def _ask_for(self, target: SparseLayer, query: Callable[[], np.ndarray], next_step: bool = False) -> bool:
        """Ask the scorer for `target`'s candidates under `query()` unless they are in flight; whether they are. Not
        for a layer that has chosen no cold tokens yet (its last picks size the candidates) or whose cold pool is too
        small to be worth it."""
        lookahead = self.runtime.lookahead
        if target.tier in lookahead.in_flight:
            return True
        if target.cold_picked is None:
            return False
        cold = self.runtime.cold
        cold.settle(target.tier)
        cold_tokens = int(cold.used[target.tier])
        if not lookahead.worth(cold_tokens):
            return False
        counts = lookahead.candidate_counts(target.cold_picked, cold_tokens, target.candidates_needed(cold_tokens))
        lookahead.start(target.tier, query(), cold_tokens, counts, next_step)
        return True

    def candidates_needed(self, cold_tokens: int) -> int:
        """Candidates a sequence needs for the hot pool and them to hold the top-alpha share of the whole pool."""
        return max(0, math.ceil(self.runtime.settings.alpha * (self.hot.used + cold_tokens)) - self.hot.used)

    def _pick_among(self, candidates: Fetched, grouped: torch.Tensor, hot_scores: torch.Tensor,
                    cold_count: int) -> tuple[Picks, torch.Tensor, Segment]:
        """The top-alpha of hot pool + the cold candidates read (prefetched or the shortlist's), scored with this
        layer's query on their full-precision keys. Returns the picks (the cold ones as rows of `candidates`), the
        candidates' scores [B, width], and the candidates as a segment (the unchosen masked). Their K/V are not copied
        out on the CPU: the weighted sum reads the values where the reads landed, and only a promotion copies
        (`_apply_swaps`)."""
        counts = candidates.counts
        positions = np.zeros((len(counts), candidates.keys.shape[2]), dtype=np.int64)
        for seq, slots in enumerate(candidates.slots):
            positions[seq, : len(slots)] = self.runtime.cold.positions[self.tier][seq][slots]
        dots, scores = candidate_scores(grouped, candidates.keys, counts, self.runtime.settings.aggregation)
        picks = Picks.top(hot_scores, scores, self.hot.positions[:, : self.hot.used], positions,
                          self.runtime.settings.alpha, pooled=hot_scores.shape[1] + cold_count)
        dots.masked_fill_(torch.from_numpy(~picks.cold_chosen)[:, None, None, :], float("-inf"))
        if self.device.type == "cpu" and weighs_in_place(candidates.values, dots.shape[2]):
            segment = candidates_in_place(dots, candidates.values, positions, counts)
        else:
            segment = Segment(dots, candidates.values, positions).to(self.device)
        return picks, scores, segment

    def _hot_segment(self, hot_dots: torch.Tensor, picks: Picks) -> Segment:
        """The chosen hot tokens: attended where they lie when the host computes, else copied to the device."""
        slots = picks.hot_slots()
        positions = picks.positions[:, : slots.shape[1]]  # past a row's own: the padding's, masked
        if self.device.type == "cpu" and weighs_in_place(self.hot.values, hot_dots.shape[2]):
            return chosen_in_place(hot_dots, self.hot.values, slots, picks.hot_counts, positions)
        return chosen_copied(hot_dots, self.hot.values, slots, picks.hot_counts, positions).to(self.device)

    def _report_attended(self, chosen: np.ndarray) -> None:
        """Tell the evaluation watcher the positions attended: sink, chosen, recent (with the new token)."""
        window = np.broadcast_to(self.window_positions, (len(chosen), len(self.window_positions)))
        sink = self.sink_tokens
        self.runtime.on_attend(self.layer_idx, np.concatenate([window[:, :sink], chosen, window[:, sink:]], axis=1))

    def _plan_swaps(self, picks: Picks, hot_scores: np.ndarray, cold_scores: np.ndarray) -> list[Swaps]:
        """Record the step in the hit table; the policy's swaps per sequence (bounded; most steps none).
        `cold_scores` [B, scored cold tokens]: the scores the picks chose among."""
        self.table.record(picks.positions)
        policy = self.runtime.policy
        if policy is None:
            return [NO_SWAPS] * len(picks.positions)
        hot_positions = self.hot.positions[:, : self.hot.used]
        planning = policy.may_promote(self.table, picks.positions, picks.hot_counts, hot_positions)
        if not planning.any():  # most steps: no sequence's own arrays needed
            return [NO_SWAPS] * len(planning)
        return [policy.plan(self.table, seq, positions, cold_scores[seq][picks.cold_rows(seq)], hot_positions[seq],
                            hot_scores[seq]) if planning[seq] else NO_SWAPS
                for seq, positions in enumerate(picks.cold_positions)]

    def _apply_swaps(self, plans: list[Swaps], picks: Picks, candidates: Fetched) -> None:
        """Promote the planned cold tokens (their K/V just fetched, in `candidates`) into the victims' hot slots, and
        back."""
        cold_pool = self.runtime.cold
        for seq, swaps in enumerate(plans):
            if not len(swaps):
                continue
            cold_positions = picks.cold_positions[seq]
            rows = picks.cold_rows(seq)
            cold_slots = candidates.slots[seq][rows]
            hot_positions = self.hot.positions[seq, : self.hot.used]
            cold_keys, cold_values = candidates.of(seq)
            victim_keys = self.hot.keys_of(seq, swaps.victims)
            victim_values = self.hot.values[seq][:, torch.from_numpy(swaps.victims)]
            victim_positions = hot_positions[swaps.victims].copy()
            promoted = torch.from_numpy(rows[swaps.promote])
            cold_pool.replace_later(self.tier, seq, cold_slots[swaps.promote], victim_keys, victim_values,
                                    victim_positions, self._swap_timer(len(swaps)))
            self.hot.replace(seq, swaps.victims, cold_keys[:, promoted], cold_values[:, promoted],
                             cold_positions[swaps.promote])
            self.meter.record(self.table.steps, seq, cold_positions[swaps.promote], +1)
            self.meter.record(self.table.steps, seq, victim_positions, -1)
            step = self.runtime.stats.current
            if step is not None:
                step.promotions += len(swaps)
                step.demotions += len(swaps)
