"""One full-attention layer of the sparse cache: device window, hot pool, cold pool, selection and exact attention.

Life of a layer:

1. Prefill (query longer than one token): K/V accumulate densely and
   attention is the model's own, exact; the attention function hands the
   layer the last prompt queries (the observation window).
2. First decode step: `distribute()` keeps the sink and recent tokens on the
   device and splits the rest between the hot pool (DRAM) and the cold pool
   (files) by the observation window's selection scores
   (hot/initial_placement.py), sized by APP (planner.py).
3. Every decode step (`attend`), the paper's step, each part one call:
   score    the query goes to the storage scorer, which scores the cold
            pool's key sketches (scorer/client.py), while the host scores the
            hot pool by exact q.k (hot/hot_pool.py) and builds the window's
            logits (selection.py);
   select   the sketch scores draw up a shortlist of cold tokens against the
            hot scores (selection.py);
   fetch    the shortlist's full-precision K/V are read from the cold pool's
            file and checked (cold/cold_pool.py);
   attend   the top-alpha of hot pool and shortlist by exact q.k is attended
            with the window, one softmax over all (selection.py); at alpha = 1
            every token is, so the output equals a dense cache up to float
            rounding. With a top-p budget (mass.py) the count is instead the
            fewest tokens whose estimated attention mass reaches P (the
            shortlist's reads follow it); either way the step reports the mass
            it kept, estimated;
   migrate  off the critical path: the hit table records the step, the
            migration policy plans and makes a bounded number of swaps
            between hot and cold pool (hot/migration.py), and the tokens
            leaving the recent window (kv/windowed.py's `retire`) enter the
            hot pool `retire_batch` at a time; when it overflows by
            `demote_batch` tokens, the coldest are demoted together. Their disk
            writes run on the cold pool's writer thread while the next layers
            compute; the layer's next step waits for them before it reads the
            cold pool.
   With the lookahead (lookahead.py) the scorer scored, shortlisted and read
   most layers' candidates ahead, with a query predicted from the previous
   layer's input, while that layer computed: such a layer's step takes them
   in place of its scorer request, select and fetch. Before a layer waits for
   them, the lookahead sends the next layers' requests, queued behind them (a
   layer that reads its own: once its reads are queued). The first layers'
   were asked for as the step before ended, with the queries they attended
   with there. stats.py times each phase of the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
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
from kvtier.sparse.mass import TopP, estimate, sketch_mass
from kvtier.sparse.selection import (
    Picks, Segment, candidate_scores, candidates_in_place, chosen_copied, chosen_in_place, cold_picks, exact_attention,
    shortlist, shortlist_for, weighs_in_place, window_segment,
)
from kvtier.sparse.stats import PhaseClock

if TYPE_CHECKING:
    from kvtier.sparse.runtime import SparseRuntime


@dataclass(slots=True)
class Scored:
    """What a decode step's scoring produced (`SparseLayer._score`)."""

    grouped: torch.Tensor  # the query, float32 [B, Hkv, G, D] on the host
    hot_dots: torch.Tensor  # the hot pool's q.k, float32 [B, Hkv, G, hot tokens]
    hot_scores: torch.Tensor  # the hot tokens' importance, float32 [B, hot tokens]
    window: Segment  # the device window's logits and values
    cold_tokens: int  # cold tokens per sequence
    # the scorer's sketch scores, float32 [B, cold_tokens]; where read ahead, those under the predicted query (the
    # mass estimate's unread tokens take them)
    cold_scores: np.ndarray
    read_ahead: Fetched | None  # the candidates the lookahead had scored and read; None where it had not
    scaling: float  # the attention's logit scale
    softcap: float | None  # the model's logit softcap, if any


@dataclass(slots=True)
class Choice:
    """A decode step's picks, with the attention mass each sequence keeps, estimated (mass.py), [B], and whether
    the top-p budget's guard lifted its ceiling, [B]."""

    picks: Picks
    kept: np.ndarray
    guarded: np.ndarray


class SparseLayer(WindowedLayer):
    """KV of one full-attention layer, tiered across device window, hot pool and cold pool."""

    def __init__(self, layer_idx: int, tier: int, runtime: SparseRuntime) -> None:
        settings = runtime.settings
        super().__init__(layer_idx, runtime.max_tokens, settings.sink, settings.recent, settings.retire_batch)
        self.tier = tier  # index among the tiered layers (cold-pool region)
        self.runtime = runtime
        # what the decode step works with, shared by the tiered layers
        self.settings, self.stats = settings, runtime.stats
        self.cold, self.scorer, self.lookahead = runtime.cold, runtime.scorer, runtime.lookahead
        self.hot: HotPool | None = None
        self.table: HitTable | None = None
        self.meter = PingPongMeter()
        self._observation: torch.Tensor | None = None
        self.cold_picked: np.ndarray | None = None  # cold tokens each sequence chose at the last step (lookahead.py)
        self.aside_tokens = 0  # window and hot tokens per sequence in a set-aside file (set_aside.py)

    def make_pool(self, batch: int, heads: int, head_dim: int) -> None:
        self.hot = HotPool(batch, heads, head_dim, self.dtype, pin=self.device.type == "cuda")
        self.table = HitTable(batch, self.runtime.max_tokens)

    def pool_tokens(self) -> tuple[int, int]:
        self.cold.settle(self.tier)
        if self.aside_tokens:
            return 0, int(self.cold.used[self.tier]) + self.aside_tokens
        return self.hot.used, int(self.cold.used[self.tier])

    # ----- prefill -----

    def observe(self, query: torch.Tensor, _scaling: float) -> None:
        """Keep the last `observation_window` prompt queries [B, Hq, w, D] for placement (which ranks by raw q.k, as
        the decode step's selection does: the attention scaling does not change the order)."""
        window = self.settings.observation_window
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
            self.cold.append(self.tier, take_tokens(pool_keys, cold_index), take_tokens(pool_values, cold_index),
                                     cold_index + pool.start)
        positions = np.arange(pool.start, pool.stop)[None, :].repeat(len(importance), axis=0)
        self.table.seed(positions, seed_hits(importance, self.settings.alpha))

    def _restore(self, stored: ImagedLayer, imaged: int) -> None:
        """Place positions [sink, imaged) as `stored` placed them: its cold slots are adopted where they lie (nothing
        is written), its hot positions are taken from the prompt's K/V, its hit table is restored."""
        hot_positions = stored.hot[stored.hot < imaged][None, :]
        index = torch.from_numpy(hot_positions[0])
        self._reserve_hot()
        self.hot.append(self.keys[:, :, index].cpu(), self.values[:, :, index].cpu(), hot_positions)
        self.cold.adopt(self.tier, stored.cold[: np.searchsorted(stored.cold, imaged)])
        self.table.restore(stored.hits[:imaged], stored.idle[:imaged])

    def _reserve_hot(self) -> None:
        """Room in the hot pool, before its first tokens, for the most it holds (planned + a demotion batch + a
        retirement batch): growing it later would copy the pool, in a decode step at the first retirement."""
        settings = self.settings
        self.hot.reserve(self.runtime.hot_tokens + settings.demote_batch + settings.retire_batch)

    def _importance(self) -> torch.Tensor:
        if self._observation is None:  # a prompt fed token by token: no window, keep newer tokens hot
            return torch.arange(self.tokens, dtype=torch.float32)[None, :].repeat(self.keys.shape[0], 1)
        return selection_importance(self._observation, self.keys, self.settings.aggregation)

    # ----- set aside while the engine runs others (set_aside.py) -----

    def set_aside(self) -> list[torch.Tensor]:
        """The layer's device window and hot pool K/V on the host, [window keys, window values, hot keys' tiles, hot
        values]; the layer lets go of them. Its cold pool (writes settled), hit table and positions stay."""
        self.cold.settle(self.tier)
        held = [self.keys.cpu(), self.values.cpu(), *self.hot.release()]
        self.aside_tokens = self.keys.shape[2] + self.hot.used
        self.keys, self.values = self.keys[:, :, :0].clone(), self.values[:, :, :0].clone()
        return held

    def bring_back(self, held: list[torch.Tensor]) -> None:
        """Restore what `set_aside` returned."""
        window_keys, window_values, key_tiles, values = held
        self.keys, self.values = window_keys.to(self.device), window_values.to(self.device)
        self.hot.restore(key_tiles, values)
        self.aside_tokens = 0

    # ----- decode: score -> select -> fetch -> attend -> migrate -----

    def attend(self, module, query: torch.Tensor, attention_mask: torch.Tensor | None,
               inner: Callable, **kwargs) -> tuple[torch.Tensor, None]:
        """Exact attention of the decode query [B, Hq, 1, D] over sink + top-alpha pooled + recent tokens: the decode
        step, score -> select -> fetch -> attend -> migrate (the module docstring), each phase timed (stats.py) and
        the step's stats added up at its end. `inner` (the model's own attention) is not needed: the hot scores are
        the logits."""
        if self.device.type == "cuda":  # the model's queued kernels finish here, not in this layer's first phase
            torch.cuda.synchronize(self.device)
        clock = PhaseClock()
        scaling = kwargs.get("scaling")
        scored = self._score(query, query.shape[-1] ** -0.5 if scaling is None else scaling, kwargs.get("softcap"),
                             clock)
        candidates = scored.read_ahead
        if candidates is None:  # not read ahead by the lookahead: the layer draws up and reads its own
            candidates = self._fetch(self._select(scored, clock), clock)
        output, choice, candidate_scores = self._attend(query, scored, candidates, attention_mask, clock)
        self._migrate(choice.picks, scored.hot_scores, candidate_scores, candidates, clock)
        step = self.stats.current
        if step is not None:
            step.add_layer(clock, scored.read_ahead is not None, len(query), self.hot.used, scored.cold_tokens,
                           choice.picks.hot_count, choice.picks.cold_count, candidates.nbytes)
            step.add_mass(choice.kept, int(choice.guarded.sum()))
        if self.runtime.on_mass is not None:
            self.runtime.on_mass(self.layer_idx, choice.kept)
        return output, None

    def _score(self, query: torch.Tensor, scaling: float, softcap: float | None, clock: PhaseClock) -> Scored:
        """Score: the query goes to the storage scorer, which scores the cold pool's sketches, while the host scores
        the hot pool by exact q.k and builds the window's logits; then the wait for the scorer's scores. Where the
        lookahead had the scorer score this layer's cold pool ahead and read the best candidates, it hands those over
        instead (`read_ahead`) and no request goes out."""
        lookahead = self.lookahead
        read_ahead = lookahead.candidates_for(self, clock) if lookahead is not None else None
        if read_ahead is not None:
            cold_scores = self.scorer.answered_scores()
        else:
            self.cold.settle(self.tier)  # last step's moves of this layer: normally on disk long since
        clock.lap("settle")
        cold_tokens = int(self.cold.used[self.tier])
        grouped = self.runtime.grouped_query(query)
        keeps_query = lookahead is not None and lookahead.asks_a_step_ahead(self.tier)
        asks = read_ahead is None and cold_tokens > 0
        if keeps_query or asks:
            own_query = self.runtime.score_query(grouped).numpy()
            if keeps_query:
                lookahead.keep_query(self.tier, own_query)
            if asks:
                self.scorer.request(self.tier, own_query, cold_tokens)
        hot_dots, hot_scores = self.hot.scores(grouped, self.settings.aggregation)
        clock.lap("hot scores")
        window = window_segment(grouped.to(self.device), self.keys, self.values, self.window_positions)
        clock.lap("window")
        if read_ahead is None:  # the wait for the scorer's answer is scoring
            cold_scores = self.scorer.scores() if cold_tokens else np.empty((len(query), 0), dtype=np.float32)
            clock.lap("cold scores")
        return Scored(grouped, hot_dots, hot_scores, window, cold_tokens, cold_scores, read_ahead, scaling, softcap)

    def _select(self, scored: Scored, clock: PhaseClock) -> list[np.ndarray]:
        """Select: the cold slots to read per sequence, the shortlist the sketch scores draw up against the hot
        scores (selection.shortlist: `candidate_margin` x the cold tokens they would pick). With the top-p budget
        the cold picks are those of the count that budget gives on the estimated masses (hot exact, cold by
        their sketch scores)."""
        settings, least = self.settings, self.candidates_needed(scored.cold_tokens)
        budget = TopP.of(settings)
        if budget is None:
            slots = shortlist(scored.hot_scores.numpy(), scored.cold_scores, settings.alpha,
                              settings.candidate_margin, least)
        else:
            (window, hot), log_z = estimate([scored.window.logits.cpu(), scored.hot_dots], scored.cold_scores,
                                            scored.scaling, scored.softcap, settings.aggregation)
            cold = sketch_mass(scored.cold_scores, log_z, scored.scaling, scored.softcap, settings.aggregation)
            counts, _ = budget.counts(window.sum(axis=1), np.concatenate([hot, cold], axis=1),
                                      self.hot.used + scored.cold_tokens)
            picked = cold_picks(hot, cold, int(counts.max(initial=0)))
            slots = shortlist_for(scored.cold_scores, picked, settings.candidate_margin, least)
        clock.lap("choice")
        return slots

    def _fetch(self, slots: list[np.ndarray], clock: PhaseClock) -> Fetched:
        """Fetch: the shortlisted `slots`' full-precision K/V read from the cold pool and checked. The lookahead's
        next requests go out once these reads are queued: they go first."""
        wait = self.cold.submit_fetch(self.tier, slots)
        if self.lookahead is not None:
            self.lookahead.ask_ahead(self)
        clock.lap("submit")
        candidates = wait()
        clock.lap("cold reads")
        return candidates

    def _attend(self, query: torch.Tensor, scored: Scored, candidates: Fetched, attention_mask: torch.Tensor | None,
                clock: PhaseClock) -> tuple[torch.Tensor, Choice, torch.Tensor]:
        """Attend: the top-alpha (or top-p) of hot pool and `candidates` by exact q.k, and one softmax over the
        window, the chosen hot tokens and the chosen candidates (selection.py); the evaluation watcher is told the
        positions. Returns the output [B, 1, Hq, D] in the query's dtype, the choice and the candidates' scores
        [B, width]."""
        choice, candidate_scores, cold = self._pick_among(candidates, scored)
        clock.lap("choice")
        picks = choice.picks
        hot = self._hot_segment(scored.hot_dots, picks)
        clock.lap("hot segment")
        output = exact_attention([scored.window, hot, cold], query, scored.scaling, attention_mask, scored.softcap)
        clock.lap("softmax")
        if self.runtime.on_attend is not None:
            self._report_attended(picks.positions)
        return output, choice, candidate_scores

    def _migrate(self, picks: Picks, hot_scores: torch.Tensor, candidate_scores: torch.Tensor, candidates: Fetched,
                 clock: PhaseClock) -> None:
        """Migrate, after attention: the hit table records the step and the policy plans its bounded swaps
        (hot/migration.py) at the promotion price of the steps before, to which this fetch's time is then added;
        the swaps are made and the tokens leaving the recent window enter the hot pool (`admit`), their disk writes
        on the cold pool's writer thread. `hot_scores` [B, hot tokens] and `candidate_scores` [B, width]: the scores
        the picks chose among."""
        swaps = self._plan_swaps(picks, hot_scores.numpy(), candidate_scores.numpy())
        clock.lap("plan")
        self.runtime.promotion_price.observe_fetch(clock.part("fetch_s"), picks.cold_count)
        self._apply_swaps(swaps, picks, candidates)
        self.cold_picked = picks.cold_counts
        retired = self.retire()
        if retired is not None:
            self.admit(*retired)
        clock.lap("after")

    def candidates_needed(self, cold_tokens: int) -> int:
        """Candidates a sequence needs for the hot pool and them to hold the share of the whole pool a step takes
        at the least: alpha, or the top-p budget's floor."""
        settings = self.settings
        share = settings.alpha if settings.top_p is None else settings.min_share
        return max(0, math.ceil(share * (self.hot.used + cold_tokens)) - self.hot.used)

    def _pick_among(self, candidates: Fetched, scored: Scored) -> tuple[Choice, torch.Tensor, Segment]:
        """The top-alpha (or top-p) of hot pool + the cold candidates read (prefetched or the shortlist's), scored
        with this layer's query on their full-precision keys. Returns the choice (the cold picks as rows of
        `candidates`, the mass kept), the candidates' scores [B, width], and the candidates as a segment (the
        unchosen masked). Their K/V are not copied out on the CPU: the weighted sum reads the values where the reads
        landed, and only a promotion copies (`_apply_swaps`)."""
        counts = candidates.counts
        positions = np.zeros((len(counts), candidates.keys.shape[2]), dtype=np.int64)
        for seq, slots in enumerate(candidates.slots):
            positions[seq, : len(slots)] = self.cold.positions[self.tier][seq][slots]
        dots, scores = candidate_scores(scored.grouped, candidates.keys, counts, self.settings.aggregation)
        choice = self._choose(scored, candidates.slots, dots, scores, positions)
        picks = choice.picks
        dots.masked_fill_(torch.from_numpy(~picks.cold_chosen)[:, None, None, :], float("-inf"))
        if self.device.type == "cpu" and weighs_in_place(candidates.values, dots.shape[2]):
            segment = candidates_in_place(dots, candidates.values, positions, counts)
        else:
            segment = Segment(dots, candidates.values, positions).to(self.device)
        return choice, scores, segment

    def _choose(self, scored: Scored, read: list[np.ndarray], dots: torch.Tensor, scores: torch.Tensor,
                positions: np.ndarray) -> Choice:
        """The picks among hot pool and the candidates read (`read`: their slots; `dots` [B, Hkv, G, width] and
        `scores` [B, width] their exact q.k and importance, -inf where padding; `positions` theirs), with the
        estimated mass each sequence keeps (mass.py: exact for window, hot pool and candidates, the unread cold
        tokens by their sketch scores). Fixed share: the top-alpha by importance; top-p budget: the budget's count
        by estimated mass."""
        settings = self.settings
        unread = scored.cold_scores.copy()
        for seq, slots in enumerate(read):
            unread[seq, slots[slots < unread.shape[1]]] = -np.inf
        (window, hot, cold), _ = estimate([scored.window.logits.cpu(), scored.hot_dots, dots], unread, scored.scaling,
                                          scored.softcap, settings.aggregation)
        window = window.sum(axis=1)
        cold = np.where(np.isfinite(scores.numpy()), cold, -np.inf)
        hot_positions = self.hot.positions[:, : self.hot.used]
        budget = TopP.of(settings)
        if budget is None:
            picks = Picks.top(scored.hot_scores, scores, hot_positions, positions, settings.alpha,
                              pooled=self.hot.used + scored.cold_tokens)
            guarded = np.zeros(len(window), dtype=bool)
        else:
            counts, guarded = budget.counts(window, np.concatenate([hot, cold], axis=1),
                                            self.hot.used + scored.cold_tokens)
            picks = Picks.ranked(hot, cold, hot_positions, positions, int(counts.max(initial=0)))
        masses = np.concatenate([hot, np.where(np.isfinite(cold), cold, 0.0)], axis=1)
        kept = window + np.take_along_axis(masses, picks.chosen, axis=1).sum(axis=1)
        return Choice(picks, kept, guarded)

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
            self.cold.replace_later(self.tier, seq, cold_slots[swaps.promote], victim_keys, victim_values,
                                    victim_positions, self._swap_timer(len(swaps)))
            self.hot.replace(seq, swaps.victims, cold_keys[:, promoted], cold_values[:, promoted],
                             cold_positions[swaps.promote])
            self.meter.record(self.table.steps, seq, cold_positions[swaps.promote], +1)
            self.meter.record(self.table.steps, seq, victim_positions, -1)
            step = self.stats.current
            if step is not None:
                step.promotions += len(swaps)
                step.demotions += len(swaps)

    def admit(self, keys: torch.Tensor, values: torch.Tensor, positions: np.ndarray) -> None:
        """Tokens leaving the recent window enter the hot pool; demote in a batch if it overflows."""
        positions = np.broadcast_to(positions, (keys.shape[0], len(positions))).copy()
        self.hot.append(keys.to("cpu"), values.to("cpu"), positions)
        self.table.seed(positions, np.ones_like(positions, dtype=np.uint8))
        overflow = self.hot.used - self.runtime.hot_tokens
        if overflow >= self.settings.demote_batch:
            self._demote(overflow)

    def _demote(self, count: int) -> None:
        policy = self.runtime.policy or HitPolicy()
        victims = policy.overflow_victims(self.table, self.hot.positions[:, : self.hot.used], count)
        keys, values, positions = self.hot.take(victims)
        self.cold.append_later(self.tier, keys, values, positions, self._background_timer())
        for seq in range(len(positions)):
            self.meter.record(self.table.steps, seq, positions[seq], -1)
        step = self.stats.current
        if step is not None:
            step.demotions += positions.size

    def _background_timer(self) -> Callable[[float], None] | None:
        """What adds a background write's duration to the current step's stats (off its critical path)."""
        step = self.stats.current
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
