"""SparseCache: the transformers Cache of `--kv sparse`, and the runtime its layers share.

Building one creates the cold-pool files in the storage dir, the shared
channel and the storage scorer process, and routes the model's attention
through attention.py. `close()` stops the scorer and deletes the files.

Budgets (bytes over all tiered layers and sequences, like the other modes):
- device: the sink + recent window (+ the new token) of every tiered layer must fit;
- host (M0): the hot pool, including the `demote_batch` tokens it may hold
  above its planned size before a batched demotion.
Sliding-window layers (Gemma 3) keep their bounded window on the device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from kvtier.errors import ConfigError
from kvtier.sparse import attention
from kvtier.sparse.cold_pool import ColdPool
from kvtier.sparse.layer import SparseLayer
from kvtier.sparse.migration import make_policy
from kvtier.sparse.planner import Plan, Throughputs, load_or_calibrate, plan_split, predicted_times
from kvtier.sparse.protocol import CONTROL_SCORER_READ_BYTES, Channel, ChannelSpec
from kvtier.sparse.scorer_client import ScorerClient
from kvtier.sparse.settings import SparseSettings
from kvtier.sparse.sketch import SketchFormat
from kvtier.sparse.stats import SparseStats
from kvtier.storage import IOEngine, IOStats
from kvtier.units import format_size


class SparseRuntime:
    """What the tiered layers of one SparseCache share: pools' files, scorer, policy, plan, stats."""

    def __init__(self, settings: SparseSettings, max_tokens: int, batch: int, heads: int, q_heads: int,
                 head_dim: int, dtype: torch.dtype, tiered: int, storage_dir: str, max_hot_tokens: int,
                 io_threads: int) -> None:
        self.settings = settings
        self.max_tokens = max_tokens
        self.max_hot_tokens = max_hot_tokens
        self.storage_dir = storage_dir
        self.heads, self.group, self.head_dim, self.dtype = heads, q_heads // heads, head_dim, dtype
        self.policy = make_policy(settings.policy, settings.max_moves, settings.promote_hits, settings.idle_steps)
        self.stats = SparseStats()
        self.plan: Plan | None = None
        self.on_attend: Callable[[int, np.ndarray], None] | None = None  # see SparseCache.watch_attended
        self.rates: Throughputs | None = None
        q_per_head = 1 if settings.aggregation == "sum" else self.group
        self.channel = Channel.create(ChannelSpec(batch, tiered, heads, q_per_head, head_dim, max_tokens))
        self.io = IOEngine(io_threads)
        self.fmt = SketchFormat.for_keys(settings.score_bits, heads, head_dim)
        self.cold: ColdPool | None = None
        self.scorer: ScorerClient | None = None
        try:
            self.cold = ColdPool(storage_dir, tiered, batch, max_tokens, heads, head_dim, dtype, self.fmt, self.io,
                                 self.channel)
            self.scorer = ScorerClient(self.channel, self.cold.sketches.path, self.cold.sketches.layout, self.fmt,
                                       settings.aggregation, settings.score_block_tokens, settings.scorer_io_threads,
                                       settings.scorer_memory_budget,
                                       crash_after_blocks=settings.crash_scorer_after_blocks)
        except BaseException:
            self.close()
            raise

    @property
    def hot_tokens(self) -> int:
        """Planned hot-pool size per layer and sequence (0 before the first layer is distributed)."""
        return self.plan.hot_tokens if self.plan is not None else 0

    def hot_tokens_for(self, importance: np.ndarray) -> int:
        """Hot tokens for a pool with this importance; planned once (by APP) on the first layer."""
        if self.plan is None:
            if self.settings.beta is None:
                self.rates = load_or_calibrate(self.storage_dir, self.heads, self.head_dim, self.dtype,
                                               self.settings.score_bits, self.settings.aggregation,
                                               block_tokens=self.settings.score_block_tokens)
            self.plan = plan_split(importance, self.settings.alpha, self.max_hot_tokens, self.rates,
                                   self.settings.beta)
        return min(self.plan.hot_tokens, importance.shape[1])

    def score_query(self, query: torch.Tensor, heads: int) -> torch.Tensor:
        """The scoring query [B, Hkv, Q, D] (float32, host) of a decode query [B, Hq, 1, D].

        "sum": Q = 1, the group's query heads summed (one dot product per KV head);
        "max": Q = group size, every query head kept.
        """
        grouped = query[:, :, 0].float().cpu().reshape(query.shape[0], heads, self.group, query.shape[-1])
        return grouped.sum(dim=2, keepdim=True) if self.settings.aggregation == "sum" else grouped

    def predict_step(self, hot: int, cold: int, batch: int) -> tuple[float, float]:
        """APP's (T_CPU, T_storage) for one layer and sequence of `batch` (0, 0 without calibrated rates)."""
        if self.rates is None or self.plan is None:
            return 0.0, 0.0
        return predicted_times(self.rates, hot, cold, self.plan.alpha_host, self.plan.alpha_storage, batch)

    def io_stats(self) -> IOStats:
        """Disk bytes moved by the host (writes, K/V fetches) and by the scorer (sketch reads)."""
        stats = self.io.stats.snapshot()
        stats.bytes_read += int(self.channel.control[CONTROL_SCORER_READ_BYTES])
        return stats

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None
        if self.cold is not None:
            self.cold.close()
            self.cold = None
        self.io.close()
        self.channel.close()


class SparseCache(Cache):
    """Cache for `model(..., cache=...)` with tiered full-attention layers and the storage scorer."""

    def __init__(self, layers: list, runtime: SparseRuntime, tiered_layers: list[int]) -> None:
        super().__init__(layers=layers)
        self.runtime = runtime
        self.first_tiered = tiered_layers[0]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        tiered = isinstance(layer, SparseLayer)
        if tiered and layer_idx == self.first_tiered and key_states.shape[2] == 1 and layer.tokens:
            self._open_step()
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        attention.hand_off(keys, layer if tiered else None)
        return keys, values

    def _open_step(self) -> None:
        step = self.runtime.stats.open_step()
        layers = [layer for layer in self.layers if isinstance(layer, SparseLayer) and layer.distributed]
        for layer in layers:
            batch = layer.keys.shape[0]
            host, storage = self.runtime.predict_step(layer.hot.used, self.runtime.cold.used[layer.tier], batch)
            step.predicted_host_s += host * batch
            step.predicted_storage_s += storage * batch

    def watch_attended(self, callback: Callable[[int, np.ndarray], None] | None) -> None:
        """Call `callback(layer_idx, positions [B, n])` with the positions each decode step attends (evaluation)."""
        self.runtime.on_attend = callback

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
        """Stop the scorer, delete the cold-pool files."""
        attention.clear_hand_off()
        self.runtime.stats.finish()
        self.runtime.close()


def make_sparse_cache(model, settings: SparseSettings, max_tokens: int, batch_size: int, storage_dir: str,
                      device_budget: int, host_budget: int, tiered_layers: list[int],
                      io_threads: int = 8) -> SparseCache:
    """A SparseCache for up to `max_tokens` tokens per sequence of `model`."""
    settings = settings.validated()
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    token_layer_bytes = 2 * heads * head_dim * torch.empty(0, dtype=model.dtype).element_size()
    per_token = token_layer_bytes * len(tiered_layers) * batch_size
    window = settings.sink + settings.recent + 1
    if window * per_token > device_budget:
        raise ConfigError(f"device KV budget {format_size(device_budget)} cannot hold the sink + recent window "
                          f"({window} tokens = {format_size(window * per_token)}); raise --device-kv-budget "
                          "or lower --sink/--recent")
    max_hot = max(0, host_budget // per_token - settings.demote_batch)
    attention.install(model)
    runtime = SparseRuntime(settings, max_tokens, batch_size, heads, config.num_attention_heads, head_dim,
                            model.dtype, len(tiered_layers), storage_dir, max_hot, io_threads)
    layers = []
    for index in range(config.num_hidden_layers):
        if index in tiered_layers:
            layers.append(SparseLayer(index, tiered_layers.index(index), runtime))
        else:
            layers.append(DynamicSlidingWindowLayer(sliding_window=config.sliding_window))
    return SparseCache(layers, runtime, tiered_layers)
