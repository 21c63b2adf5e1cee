"""SparseCache: the transformers Cache of `--kv sparse` (its layers share a SparseRuntime, runtime.py).

Building one creates the cold-pool files in the storage dir, the shared
channel and the storage scorer process, and routes the model's attention
through attention.py. `close()` stops the scorer and deletes the files.

Budgets (bytes over all tiered layers and sequences, like the other modes):
- device: the sink + recent window (+ up to `retire_batch` newer tokens) of every tiered layer must fit;
- host (M0): the hot pool, including the `demote_batch` tokens it may hold
  above its planned size before a batched demotion.
Sliding-window layers (Gemma 3) keep their bounded window on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from kvtier.errors import ConfigError, setting
from kvtier.kv.contract import SelectiveKVCache
from kvtier.kv.model_geometry import model_geometry, text_config
from kvtier.sparse import attention
from kvtier.sparse.cold.cold_image import ColdImage, save_image
from kvtier.sparse.layer import SparseLayer
from kvtier.sparse.lookahead import Lookahead, QueryForecast
from kvtier.sparse.planner import Plan
from kvtier.sparse.record_file import RecordFile
from kvtier.sparse.runtime import SparseRuntime
from kvtier.sparse.set_aside import SetAside, bring_back, discard, set_aside
from kvtier.sparse.settings import SparseSettings
from kvtier.sparse.stats import SparseStats
from kvtier.storage import IOStats
from kvtier.units import format_size


class SparseCache(Cache, SelectiveKVCache):
    """Cache for `model(..., cache=...)` with tiered full-attention layers and the storage scorer."""

    def __init__(self, layers: list, runtime: SparseRuntime, tiered_layers: list[int]) -> None:
        super().__init__(layers=layers)
        self.runtime = runtime
        self.first_tiered = tiered_layers[0]
        self._aside: SetAside | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        tiered = isinstance(layer, SparseLayer)
        if tiered and layer_idx == self.first_tiered and key_states.shape[2] == 1 and layer.tokens:
            self._open_step()
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        attention.hand_off(keys, layer if tiered else None)
        return keys, values

    def _open_step(self) -> None:
        if self.runtime.lookahead is not None:
            self.runtime.lookahead.open_step()  # what the last step asked for this one stays in flight
        step = self.runtime.stats.open_step()
        layers = [layer for layer in self.layers if isinstance(layer, SparseLayer) and layer.distributed]
        for layer in layers:
            batch = layer.keys.shape[0]
            host, storage = self.runtime.predict_step(layer.hot.used, int(self.runtime.cold.used[layer.tier]), batch)
            step.predicted_host_s += host * batch
            step.predicted_storage_s += storage * batch

    def place_prompt(self) -> None:
        """Split the prompt's K/V into device window, hot and cold pools now, at the end of prefill,
        rather than inside the first decode step (which then costs what any later step costs)."""
        for layer in self.layers:
            if isinstance(layer, SparseLayer) and layer.tokens and not layer.distributed:
                layer.distribute()

    def save_placed(self, entry_dir: Path, tokens: int) -> None:
        """After `place_prompt`: add the placed tiers of positions < `tokens` to the document store entry in
        `entry_dir` (its sparse image, cold_image.py), unless it holds them for these settings."""
        layers = sorted((layer for layer in self.layers if isinstance(layer, SparseLayer)), key=lambda layer: layer.tier)
        save_image(entry_dir, self.runtime, layers, tokens)

    def set_aside(self) -> int:
        """Let go of the device windows and hot pools, written to a file beside the cold pool (set_aside.py), while
        the serving engine runs other sequences; returns the bytes written. Only after the prompt is placed.
        Raises StorageError with the cache as it was."""
        if self._aside is not None or not all(layer.distributed for layer in self._tiered()):
            raise RuntimeError("set_aside: the cache is set aside already, or its prompt is not placed yet")
        self._aside = set_aside(self._tiered(), self.runtime.cold.stem, self.runtime.io)
        return self._aside.nbytes

    def bring_back(self) -> None:
        """Resume after `set_aside`, exactly as the cache was. Raises ChecksumError or StorageError when the file
        cannot be read back whole (the cache stays set aside; close it)."""
        bring_back(self._tiered(), self._aside, self.runtime.io)
        self._aside = None

    @property
    def set_aside_bytes(self) -> int:
        """Bytes of the set-aside file (0 while the cache runs)."""
        return self._aside.nbytes if self._aside is not None else 0

    def _tiered(self) -> list[SparseLayer]:
        return [layer for layer in self.layers if isinstance(layer, SparseLayer)]

    def locate(self, row: int) -> None:
        """In a packed forward of several sequences (the serving engine's), this batch-1 cache's token is at `row`:
        the lookahead predicts queries from that token's hidden state."""
        if self.runtime.lookahead is not None:
            self.runtime.lookahead.forecast.row = row

    def stored_in_place(self) -> ColdImage | None:
        """The stored sparse image this cache uses in place, if any."""
        return self.runtime.image

    def storage_files(self) -> list[RecordFile]:
        """The cold pool's K|V records and key sketches."""
        return [self.runtime.cold.kv, self.runtime.cold.sketches]

    def scorer_restarts(self) -> int:
        return self.runtime.scorer.restarts

    def attention_budget(self) -> dict[str, float | int | None]:
        return self.runtime.stats.budget_report()

    def sparse_view(self) -> SparseCache:
        return self

    @property
    def plan(self) -> Plan | None:
        """APP's split of the pool (None until the first tiered layer is placed)."""
        return self.runtime.plan

    @property
    def hot_tokens(self) -> int:
        """Planned hot-pool size per layer and sequence (0 before the first tiered layer is placed)."""
        return self.runtime.hot_tokens

    @property
    def io_backend(self) -> str:
        """How the cold reads reach the disk: kernel AIO or the thread pool."""
        return self.runtime.io.backend

    @property
    def scorer_host_fallbacks(self) -> int:
        """Scorer requests (partly) scored on the host after a fault."""
        return self.runtime.scorer.host_scored_requests

    def step_summary(self) -> dict[str, float]:
        """Mean per decode step of every recorded field over the steps after the first (its placement's warm-up)."""
        return self.runtime.stats.summary(skip=1)

    def scorer_round_trip_s(self, repeats: int) -> float:
        """Median seconds of an empty scorer request over `repeats`, the protocol's fixed cost per layer."""
        if self.runtime.lookahead is not None:
            self.runtime.lookahead.drain()  # the last step's requests for the next one: the round trip waits alone
        return self.runtime.scorer.round_trip_s(repeats=repeats)

    def watch_attended(self, callback: Callable[[int, np.ndarray], None] | None) -> None:
        """Call `callback(layer_idx, positions [B, n])` with the positions each decode step attends (evaluation)."""
        self.runtime.on_attend = callback

    def watch_mass(self, callback: Callable[[int, np.ndarray], None] | None) -> None:
        """Call `callback(layer_idx, kept [B])` with the attention mass each decode step keeps, as estimated
        (mass.py; evaluation checks it against a dense cache's)."""
        self.runtime.on_mass = callback

    @property
    def stats(self) -> SparseStats:
        return self.runtime.stats

    def io_stats(self) -> IOStats:
        return self.runtime.io_stats()

    def ping_pong(self) -> tuple[int, int]:
        """(moves, ping-pong moves) summed over the tiered layers."""
        meters = [layer.meter for layer in self.layers if isinstance(layer, SparseLayer)]
        return sum(meter.moves for meter in meters), sum(meter.ping_pongs for meter in meters)

    def close(self) -> None:
        """Stop the scorer, delete the cold-pool files (and a set-aside file)."""
        if self._aside is not None:
            discard(self._aside)
            self._aside = None
        attention.clear_hand_off()
        self.runtime.stats.finish()
        self.runtime.close()


def make_sparse_cache(model, settings: SparseSettings, max_tokens: int, batch_size: int, storage_dir: str,
                      device_budget: int, host_budget: int, tiered_layers: list[int],
                      io_threads: int = 8, entry_dir: Path | None = None, image_tokens: int = 0,
                      route_attention: bool = True) -> SparseCache:
    """A SparseCache for up to `max_tokens` tokens per sequence of `model`; `entry_dir`: the document store entry
    of the first `image_tokens` prompt tokens, whose sparse image for these settings is used in place (SparseRuntime)."""
    settings = settings.validated()
    config = text_config(model)
    geometry = model_geometry(model, tiered_layers)
    heads, head_dim = geometry.num_kv_heads, geometry.head_dim
    per_token = geometry.token_bytes * batch_size
    window = settings.sink + settings.recent + settings.retire_batch
    if window * per_token > device_budget:
        raise ConfigError(f"device KV budget {format_size(device_budget)} cannot hold the sink + recent window and "
                          f"the tokens waiting to retire from it ({window} tokens = {format_size(window * per_token)}); "
                          f"raise {setting('device_kv_budget')} or lower {setting('sink')} / {setting('recent')}")
    max_hot = max(0, host_budget // per_token - settings.demote_batch)
    if route_attention:  # else the caller routes the model's attention (the serving engine: attention.function)
        attention.install(model)
    runtime = SparseRuntime(settings, max_tokens, batch_size, heads, config.num_attention_heads, head_dim,
                            model.dtype, len(tiered_layers), storage_dir, max_hot, io_threads, entry_dir, image_tokens)
    if settings.lookahead:
        try:
            forecast = QueryForecast(model, heads, summed=settings.aggregation == "sum")
            runtime.lookahead = Lookahead(forecast, settings.candidate_margin, settings.lookahead_skip,
                                          settings.lookahead_min_cold, runtime.scorer, runtime.cold)
        except BaseException:
            runtime.close()
            raise
    layers = []
    for index in range(config.num_hidden_layers):
        if index in tiered_layers:
            layers.append(SparseLayer(index, tiered_layers.index(index), runtime))
        else:
            layers.append(DynamicSlidingWindowLayer(sliding_window=config.sliding_window))
    if runtime.lookahead is not None:
        runtime.lookahead.chain([layer for layer in layers if isinstance(layer, SparseLayer)])
    return SparseCache(layers, runtime, tiered_layers)
