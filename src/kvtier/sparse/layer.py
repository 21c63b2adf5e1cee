"""One full-attention layer of the sparse cache: device window, hot pool, cold pool, selection and exact attention.

Life of a layer:

1. Prefill (query longer than one token): K/V accumulate densely and
   attention is the model's own, exact; the attention function hands the
   layer the last prompt queries (the observation window).
2. First decode step: `distribute()` keeps the sink and recent tokens on the
   device and splits the rest between the hot pool (DRAM) and the cold pool
   (files) by observation-window importance (placement.py), sized by APP.
3. Every decode step (`attend`): the query goes to the storage scorer (cold
   pool) and scores the hot pool meanwhile; the global top-alpha of the pooled
   tokens is fetched in full precision (hot from DRAM, cold from the K/V
   file), put in position order between the sink and recent tokens, and the
   model's own attention function runs on exactly those tokens. At alpha = 1
   that is every token in order, so the output equals a dense cache bit for bit.
4. After attention: the hit table records the selection and the migration
   policy swaps a bounded number of cold and hot tokens. Tokens leaving the
   recent window enter the hot pool; when it overflows by `demote_batch`
   tokens, the coldest are demoted together (one sequential write).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from kvtier.errors import ConfigError
from kvtier.kv.gather import select_columns, take_tokens
from kvtier.sparse.hit_table import HitTable
from kvtier.sparse.hot_pool import HotPool
from kvtier.sparse.migration import HitPolicy, PingPongMeter
from kvtier.sparse.placement import observation_importance, seed_hits, split_hot_cold

if TYPE_CHECKING:
    from kvtier.sparse.cache import SparseRuntime


class SparseLayer(CacheLayerMixin):
    """KV of one full-attention layer, tiered across device window, hot pool and cold pool."""

    is_sliding = False

    def __init__(self, layer_idx: int, tier: int, runtime: SparseRuntime) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tier = tier  # index among the tiered layers (cold-pool region)
        self.runtime = runtime
        self.tokens = 0
        self.distributed = False
        self.hot: HotPool | None = None
        self.table: HitTable | None = None
        self.meter = PingPongMeter()
        self.window_positions = np.empty(0, dtype=np.int64)
        self.sink_tokens = 0
        self._observation: torch.Tensor | None = None
        self._scaling = 1.0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        batch, heads, _, head_dim = key_states.shape
        self.hot = HotPool(batch, heads, head_dim, self.dtype)
        self.table = HitTable(batch, self.runtime.max_tokens)
        self.is_initialized = True

    # ----- cache protocol -----

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        count = key_states.shape[2]
        if not self.distributed and (count > 1 or self.tokens == 0):
            self.keys = torch.cat([self.keys, key_states], dim=2)
            self.values = torch.cat([self.values, value_states], dim=2)
            self.tokens += count
            return self.keys, self.values
        if count > 1:
            raise ConfigError("the sparse KV cache decodes one token per forward pass after the prompt; "
                              "feed the whole prompt before decoding")
        if not self.distributed:
            self.distribute()
        self.keys = torch.cat([self.keys, key_states], dim=2)
        self.values = torch.cat([self.values, value_states], dim=2)
        self.window_positions = np.append(self.window_positions, self.tokens)
        self.tokens += 1
        self._retire_oldest_recent()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tokens + query_length, 0

    def get_max_length(self) -> int:
        return self.runtime.max_tokens

    def tier_tokens(self) -> dict[str, int]:
        """Tokens per sequence in each tier."""
        if not self.distributed:
            return {"device": self.tokens, "host": 0, "storage": 0}
        return {"device": self.keys.shape[2], "host": self.hot.used, "storage": self.runtime.cold.used[self.tier]}

    # ----- prefill -----

    def observe(self, query: torch.Tensor, scaling: float) -> None:
        """Keep the last `observation_window` prompt queries [B, Hq, w, D] for placement."""
        window = self.runtime.settings.observation_window
        recent = query if self._observation is None else torch.cat([self._observation, query], dim=2)
        self._observation = recent[:, :, -window:].clone()
        self._scaling = scaling

    def distribute(self) -> None:
        """Split the prompt's K/V into device window, hot pool and cold pool (after prefill)."""
        settings, tokens = self.runtime.settings, self.tokens
        sink = min(settings.sink, tokens)
        recent_start = max(sink, tokens - settings.recent)
        if recent_start > sink:
            pool = slice(sink, recent_start)
            importance = self._importance()[:, pool].numpy()
            hot_index, cold_index = split_hot_cold(importance, self.runtime.hot_tokens_for(importance))
            pool_keys, pool_values = self.keys[:, :, pool].cpu(), self.values[:, :, pool].cpu()
            self.hot.append(take_tokens(pool_keys, hot_index), take_tokens(pool_values, hot_index), hot_index + sink)
            if cold_index.shape[1]:
                self.runtime.cold.append(self.tier, take_tokens(pool_keys, cold_index),
                                         take_tokens(pool_values, cold_index), cold_index + sink)
            positions = np.arange(sink, recent_start)[None, :].repeat(len(importance), axis=0)
            self.table.seed(positions, seed_hits(importance, settings.alpha))
        keep = torch.cat([torch.arange(sink), torch.arange(recent_start, tokens)])
        self.keys, self.values = self.keys[:, :, keep].clone(), self.values[:, :, keep].clone()
        self.window_positions = keep.numpy().astype(np.int64)
        self.sink_tokens = sink
        self._observation = None
        self.distributed = True

    def _importance(self) -> torch.Tensor:
        if self._observation is None:  # a prompt fed token by token: no window, keep newer tokens hot
            return torch.arange(self.tokens, dtype=torch.float32)[None, :].repeat(self.keys.shape[0], 1)
        return observation_importance(self._observation, self.keys, self._scaling)

    # ----- decode -----

    def _retire_oldest_recent(self) -> None:
        """Move tokens past the recent window into the hot pool; demote in a batch if it overflows."""
        excess = self.keys.shape[2] - self.sink_tokens - self.runtime.settings.recent
        if excess <= 0:
            return
        moving = slice(self.sink_tokens, self.sink_tokens + excess)
        positions = np.broadcast_to(self.window_positions[moving], (self.keys.shape[0], excess)).copy()
        self.hot.append(self.keys[:, :, moving].to("cpu"), self.values[:, :, moving].to("cpu"), positions)
        self.table.seed(positions, np.ones_like(positions, dtype=np.uint8))
        keep = torch.cat([torch.arange(self.sink_tokens), torch.arange(moving.stop, self.keys.shape[2])])
        self.keys, self.values = self.keys[:, :, keep], self.values[:, :, keep]
        self.window_positions = np.delete(self.window_positions, np.arange(moving.start, moving.stop))
        overflow = self.hot.used - self.runtime.hot_tokens
        if overflow >= self.runtime.settings.demote_batch:
            self._demote(overflow)

    def _demote(self, count: int) -> None:
        started = time.perf_counter()
        policy = self.runtime.policy or HitPolicy()
        victims = policy.overflow_victims(self.table, self.hot.positions[:, : self.hot.used], count)
        keys, values, positions = self.hot.take(victims)
        self.runtime.cold.append(self.tier, keys, values, positions)
        for seq in range(len(positions)):
            self.meter.record(self.table.steps, seq, positions[seq], -1)
        step = self.runtime.stats.current
        if step is not None:
            step.migrate_s += time.perf_counter() - started
            step.demotions += positions.size

    def attend(self, module, query: torch.Tensor, attention_mask: torch.Tensor | None,
               inner: Callable, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sparse attention of the decode query [B, Hq, 1, D] over sink + top-alpha pooled + recent tokens."""
        step = self.runtime.stats.current
        cold_count = self.runtime.cold.used[self.tier]
        started = time.perf_counter()
        score_query = self.runtime.score_query(query, self.keys.shape[1])
        if cold_count:
            self.runtime.channel.query[:] = score_query.numpy()
            self.runtime.scorer.submit(self.tier, cold_count)
        hot_scores = self.hot.score(score_query, self.runtime.settings.aggregation)
        host_scored = time.perf_counter()
        if cold_count:
            self.runtime.scorer.wait()
            cold_scores = torch.from_numpy(self.runtime.channel.results["score"][:, :cold_count].copy())
        else:
            cold_scores = hot_scores.new_empty(len(hot_scores), 0)
        cold_scored = time.perf_counter()
        scores = torch.cat([hot_scores, cold_scores], dim=1)
        chosen = scores.topk(math.ceil(self.runtime.settings.alpha * scores.shape[1]), dim=1).indices.numpy()
        selected = self._fetch(chosen, self.hot.used)
        fetched = time.perf_counter()
        attended_positions = self._attended_positions(selected.positions)
        if self.runtime.on_attend is not None:
            self.runtime.on_attend(self.layer_idx, attended_positions)
        mask = select_columns(attention_mask, attended_positions)
        output = inner(module, query, selected.keys, selected.values, mask, **kwargs)
        attended = time.perf_counter()
        self._migrate(selected, hot_scores.numpy(), cold_scores.numpy())
        if step is not None:
            step.score_s += max(host_scored, cold_scored) - started
            step.fetch_s += fetched - cold_scored
            step.attention_s += attended - fetched
            step.migrate_s += time.perf_counter() - attended
            step.host_time_s += host_scored - started + selected.hot_fetch_s
            step.storage_time_s += (cold_scored - started if cold_count else 0.0) + selected.cold_fetch_s
            step.selected_hot += selected.hot_count
            step.selected_cold += selected.cold_count
            step.pooled_hot += self.hot.used * len(query)
            step.pooled_cold += cold_count * len(query)
            step.cold_pages_read += selected.pages
        return output

    def _attended_positions(self, selected_positions: np.ndarray) -> np.ndarray:
        """Positions [B, attended] in the order of the attended K/V: sink, selected, recent."""
        window = np.broadcast_to(self.window_positions, (len(selected_positions), len(self.window_positions)))
        return np.concatenate([window[:, : self.sink_tokens], selected_positions, window[:, self.sink_tokens :]], axis=1)

    def _fetch(self, chosen: np.ndarray, hot_used: int) -> "Selection":
        """The attended K/V: sink, the chosen pooled tokens (hot slots < hot_used, then cold), recent window.

        Chosen tokens are fetched in full precision and copied once, straight to their place in position
        order (assembling it by concatenations copied the selection four times: ~50 of 310 ms per step
        at 8K under cProfile).
        The cold reads of every sequence go to the disk together (one wait per layer, not one per sequence).
        """
        selection = Selection()
        hot_slots = [np.sort(picks[picks < hot_used]) for picks in chosen]
        selection.cold_slots = [np.sort(picks[picks >= hot_used] - hot_used) for picks in chosen]
        started = time.perf_counter()
        cold = self.runtime.cold.fetch_many(self.tier, selection.cold_slots)
        selection.cold_fetch_s = time.perf_counter() - started
        selection.keys, selection.values = self._around_window(self.keys, chosen.shape[1]), \
            self._around_window(self.values, chosen.shape[1])
        positions = []
        for seq, (cold_keys, cold_values, pages) in enumerate(cold):
            cold_slots = selection.cold_slots[seq]
            seq_positions = np.concatenate([self.hot.positions[seq, hot_slots[seq]],
                                            self.runtime.cold.positions[self.tier, seq, cold_slots]])
            order = np.argsort(seq_positions, kind="stable")
            place = np.empty_like(order)
            place[order] = np.arange(len(order)) + self.sink_tokens  # where each chosen token goes
            place = torch.from_numpy(place)
            hot_started, hot_count = time.perf_counter(), len(hot_slots[seq])
            hot_index = torch.from_numpy(hot_slots[seq])
            for target, pool in ((selection.keys[seq], self.hot.keys[seq]), (selection.values[seq], self.hot.values[seq])):
                target.index_copy_(1, place[:hot_count], pool.index_select(1, hot_index).to(self.device))
            cold_started = time.perf_counter()
            selection.keys[seq].index_copy_(1, place[hot_count:], cold_keys.to(self.device))
            selection.values[seq].index_copy_(1, place[hot_count:], cold_values.to(self.device))
            selection.hot_fetch_s += cold_started - hot_started
            selection.cold_fetch_s += time.perf_counter() - cold_started
            positions.append(seq_positions[order])
            selection.cold_keys.append(cold_keys)
            selection.cold_values.append(cold_values)
            selection.hot_count += hot_count
            selection.cold_count += len(cold_slots)
            selection.pages += pages
        selection.positions = np.stack(positions)
        return selection

    def _around_window(self, window: torch.Tensor, chosen: int) -> torch.Tensor:
        """[B, H, sink + chosen + recent, D] holding the device window's sink and recent tokens, with room between."""
        batch, heads, length, head_dim = window.shape
        out = window.new_empty(batch, heads, length + chosen, head_dim)
        out[:, :, : self.sink_tokens] = window[:, :, : self.sink_tokens]
        out[:, :, self.sink_tokens + chosen :] = window[:, :, self.sink_tokens :]
        return out

    def _migrate(self, selection: "Selection", hot_scores: np.ndarray, cold_scores: np.ndarray) -> None:
        """Record the step in the hit table, then swap promoted cold tokens with demoted hot ones."""
        self.table.record(selection.positions, self.tokens)
        policy = self.runtime.policy
        if policy is None:
            return
        cold = self.runtime.cold
        for seq, cold_slots in enumerate(selection.cold_slots):
            if not len(cold_slots):
                continue
            cold_positions = cold.positions[self.tier, seq, cold_slots].astype(np.int64)
            hot_positions = self.hot.positions[seq, : self.hot.used]
            swaps = policy.plan(self.table, seq, cold_positions, cold_scores[seq, cold_slots], hot_positions,
                                hot_scores[seq])
            if not len(swaps):
                continue
            victim_index = torch.from_numpy(swaps.victims)
            victim_keys = self.hot.keys[seq][:, victim_index]
            victim_values = self.hot.values[seq][:, victim_index]
            victim_positions = hot_positions[swaps.victims].copy()
            promoted = torch.from_numpy(swaps.promote)
            cold.replace(self.tier, seq, cold_slots[swaps.promote], victim_keys, victim_values, victim_positions)
            self.hot.replace(seq, swaps.victims, selection.cold_keys[seq][:, promoted],
                             selection.cold_values[seq][:, promoted], cold_positions[swaps.promote])
            self.meter.record(self.table.steps, seq, cold_positions[swaps.promote], +1)
            self.meter.record(self.table.steps, seq, victim_positions, -1)
            step = self.runtime.stats.current
            if step is not None:
                step.promotions += len(swaps)
                step.demotions += len(swaps)


class Selection:
    """The pooled tokens chosen for one step's attention, and what fetching them cost."""

    def __init__(self) -> None:
        self.keys = self.values = None  # the attended K/V [B, H, sink + chosen + recent, D]
        self.positions = np.empty((0, 0), dtype=np.int64)
        self.cold_slots: list[np.ndarray] = []
        self.cold_keys: list[torch.Tensor] = []
        self.cold_values: list[torch.Tensor] = []
        self.hot_count = self.cold_count = self.pages = 0
        self.hot_fetch_s = self.cold_fetch_s = 0.0
