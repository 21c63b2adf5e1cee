"""The layer and cache every baseline builds on: tiered KV, a chosen subset attended exactly.

A tiered (full-attention) layer keeps its tokens where the other modes do,
per sequence (all sequences of a batch hold the same counts):

    device   sink tokens + recent window (the new token completes it): always attended, as in --kv sparse
    pool     every other token in position order, as [storage blocks | host tokens]: the oldest whole blocks in
             the cache's KVBlockFile (O_DIRECT, IOEngine), the newest in host DRAM (HostTokens) up to the host budget

Pool index i is the token at position sink + i; indices below `stored_tokens` are on disk, in block i // T.

Life of a layer:
1. Prefill is dense (the model's own attention); `observe` shows the baseline each prompt chunk's queries.
2. First decode step: `distribute` keeps the sink and all but one recent token on the device and admits the rest
   into the pool (host, then whole blocks spilled to disk, oldest first). Leaving room for the new token keeps the
   pool unchanged from the start of a step until its attention, so InfiniGen can select before the layer runs.
3. Each decode step, `attend`: the baseline's `select` returns ceil(alpha x pooled) pool tokens in position order
   with their K/V, reading from disk what its design reads; the model's own attention function runs over sink +
   selected + recent. At alpha = 1 that is every token in order: output equal to the dense cache bit for bit.
4. After attention the token leaving the recent window joins the pool (full host blocks spill to disk), and the
   next tiered layer starts its query-independent reads (H2O's keys, LeoAM's abstracts) so they overlap compute.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from kvtier.baselines.host_tokens import HostTokens
from kvtier.baselines.selective_runtime import SelectiveRuntime, TierSetup, plan_capacity
from kvtier.baselines.selective_store import SelectiveStore
from kvtier.kv.contract import DiskFile, SelectiveKVCache
from kvtier.kv.gather import select_columns, take_tokens
from kvtier.kv.windowed import WindowedLayer
from kvtier.kv.model_geometry import model_geometry, text_config
from kvtier.sparse import attention
from kvtier.storage import K, IOStats


@dataclass
class Selected:
    """Pool tokens chosen for one step: indices [B, k] ascending, K/V [B, H, k, D] in the same order."""

    index: np.ndarray
    keys: torch.Tensor
    values: torch.Tensor


class SelectiveLayer(WindowedLayer):
    """One full-attention layer: device window, pool in host DRAM and on disk, attention over what `select` picks."""

    def __init__(self, layer_idx: int, runtime: SelectiveRuntime) -> None:
        # One recent slot is left free at distribution, for the new token (see the module docstring).
        super().__init__(layer_idx, runtime.setup.max_tokens, runtime.settings.sink, runtime.settings.recent - 1)
        self.runtime = runtime
        self.host: HostTokens | None = None
        self._prefetched: Future | None = None

    # ----- what a baseline defines -----

    @abstractmethod
    def select(self, query: torch.Tensor, scaling: float) -> Selected:
        """The pool tokens the decode query [B, Hq, 1, D] attends, with their K/V."""

    def prepare(self, pool_keys: torch.Tensor) -> None:
        """The prompt's pool keys [B, H, P, D], once, before they enter the pool."""

    def on_admit(self, keys: torch.Tensor, first: int) -> None:
        """Keys [B, H, n, D] (host) of tokens entering the pool at pool index `first`."""

    def whole_reads(self) -> tuple[SelectiveStore, tuple[int, ...]] | None:
        """The store and kinds read entirely every step (prefetched one layer ahead), if any."""
        return None

    # ----- the pool -----

    def make_pool(self, batch: int, heads: int, head_dim: int) -> None:
        self.host = HostTokens(batch, heads, head_dim, self.dtype)

    def pool_tokens(self) -> tuple[int, int]:
        return self.host.used, self.stored_tokens

    @property
    def stored_tokens(self) -> int:
        return self.runtime.kv.stored_tokens(self.layer_idx)

    @property
    def pooled_tokens(self) -> int:
        return self.stored_tokens + self.host.used

    def selection_size(self) -> int:
        """Pool tokens attended per step: the top-alpha share, as in --kv sparse."""
        return math.ceil(self.runtime.settings.alpha * self.pooled_tokens)

    def place(self, pool: slice) -> None:
        self.prepare(self.keys[:, :, pool])
        self.admit(self.keys[:, :, pool], self.values[:, :, pool], self.window_positions[pool])

    def admit(self, keys: torch.Tensor, values: torch.Tensor, positions: np.ndarray) -> None:
        """Tokens (in position order) join the pool's host part; whole blocks beyond its capacity spill to disk."""
        count = keys.shape[2]
        if not count:
            return
        keys, values, first = keys.cpu(), values.cpu(), self.pooled_tokens
        self.on_admit(keys, first)
        self.host.append(keys, values)
        self._spill()

    def _spill(self) -> None:
        block = self.runtime.capacity.block_tokens
        excess = self.host.used - self.runtime.capacity.host_tokens
        if excess <= 0:
            return
        move = min(-(-excess // block), self.host.used // block) * block  # a partial block waits in DRAM
        if move:
            keys, values = self.host.pop_front(move)
            self.runtime.kv.append(self.layer_idx, keys, values)

    # ----- reading the pool -----

    def gather(self, index: np.ndarray, kind: int, buffer: int = 0, seq: int | None = None) -> torch.Tensor:
        """K or V [B, H, k, D] of pool indices [B, k] (or [1, H, k, D] of one sequence `seq`).

        Disk rows come from the store's `buffer`, where they must have been read; the rest from DRAM.
        """
        rows = slice(None) if seq is None else slice(seq, seq + 1)
        stored, used = self.stored_tokens, self.host.used
        host = (self.host.keys if kind == K else self.host.values)[rows]
        disk = self.runtime.kv.tokens(kind, buffer)[rows].permute(0, 2, 1, 3)
        if not used:
            return take_tokens(disk, index)
        if not stored:
            return take_tokens(host, index)
        from_disk = take_tokens(disk, np.minimum(index, stored - 1))
        from_host = take_tokens(host, np.maximum(index - stored, 0))
        return torch.where(torch.from_numpy(index < stored)[:, None, :, None], from_disk, from_host)

    def pooled(self, kind: int) -> torch.Tensor:
        """All pool K or V [B, H, P, D] (host), once the stored blocks of `kind` are in buffer 0."""
        stored = self.runtime.kv.tokens(kind)[:, : self.stored_tokens].permute(0, 2, 1, 3)
        return torch.cat([stored, self.host.keys if kind == K else self.host.values], dim=2)

    def load_whole(self) -> None:
        """This step's whole reads: the prefetch started one layer ahead, or a read now (first step)."""
        store, kinds = self.whole_reads()
        if self._prefetched is not None:
            self._prefetched.result()
            self._prefetched = None
        else:
            store.read(self.layer_idx, store.all_blocks(self.layer_idx, kinds))

    def start_prefetch(self) -> None:
        """Submit the next step's whole reads (no-op before distribution or for baselines without them)."""
        source = self.whole_reads()
        if source is not None and self.distributed:
            store, kinds = source
            self._prefetched = store.submit(self.layer_idx, store.all_blocks(self.layer_idx, kinds))

    # ----- decode attention -----

    def attend(self, module, query: torch.Tensor, attention_mask: torch.Tensor | None,
               inner: Callable, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of the decode query [B, Hq, 1, D] over sink + selected pool tokens + recent window."""
        scaling = kwargs.get("scaling")
        chosen = self.select(query, scaling if scaling is not None else query.shape[-1] ** -0.5)
        sink = self.sink_tokens
        keys = torch.cat([self.keys[:, :, :sink], chosen.keys.to(self.device), self.keys[:, :, sink:]], dim=2)
        values = torch.cat([self.values[:, :, :sink], chosen.values.to(self.device), self.values[:, :, sink:]], dim=2)
        window = np.broadcast_to(self.window_positions, (len(chosen.index), len(self.window_positions)))
        positions = np.concatenate([window[:, :sink], chosen.index + sink, window[:, sink:]], axis=1)
        if self.runtime.on_attend is not None:
            self.runtime.on_attend(self.layer_idx, positions)
        output = inner(module, query, keys, values, select_columns(attention_mask, positions), **kwargs)
        retired = self.retire()
        if retired is not None:
            self.admit(*retired)
        self.runtime.following(self).start_prefetch()
        return output


def grouped_query(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A decode query [B, Hq, 1, D] as float32 [B, Hkv, group, D] on the host (query heads of a KV head together)."""
    batch, q_heads, _, head_dim = query.shape
    return query[:, :, 0].float().cpu().reshape(batch, kv_heads, q_heads // kv_heads, head_dim)


class SelectiveCache(Cache, SelectiveKVCache):
    """Cache for `model(..., cache=...)` whose tiered layers attend what their baseline selects.

    Sliding-window layers (Gemma 3) keep their bounded window on the device.
    """

    def __init__(self, layers: list, runtime: SelectiveRuntime) -> None:
        super().__init__(layers=layers)
        self.runtime = runtime

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        attention.hand_off(keys, layer if isinstance(layer, SelectiveLayer) else None)
        return keys, values

    def watch_attended(self, callback: Callable[[int, np.ndarray], None] | None) -> None:
        """Call `callback(layer_idx, positions [B, n])` with the positions each decode step attends (evaluation)."""
        self.runtime.on_attend = callback

    def io_stats(self) -> IOStats:
        """Bytes read from and written to the cache's files so far."""
        return self.runtime.io_stats()

    def storage_files(self) -> list[DiskFile]:
        return [store.file for store in self.runtime.stores]

    def close(self) -> None:
        """Remove hooks, finish pending reads, delete the files."""
        attention.clear_hand_off()
        self.runtime.close()


def build_cache(model, setup: TierSetup, make_layer: Callable[[int, SelectiveRuntime], SelectiveLayer],
                host_reserved: int = 0, reserved_for: str = "", buffers: int = 1,
                extra_stores: dict[str, int] | None = None) -> SelectiveCache:
    """A SelectiveCache for `model` whose tiered layers come from `make_layer(layer_idx, runtime)`.

    `host_reserved` bytes of the host budget pay for `reserved_for`; `buffers` staging buffers for the KV file;
    `extra_stores` more block files (name -> rows per layer and sequence), as `runtime.extra[name]`.
    """
    geometry = model_geometry(model, setup.tiered_layers)
    capacity = plan_capacity(setup, geometry, host_reserved, reserved_for)
    attention.install(model)
    runtime = SelectiveRuntime(setup, geometry, capacity, buffers, extra_stores)
    config = text_config(model)
    try:
        layers = [make_layer(index, runtime) if index in setup.tiered_layers
                  else DynamicSlidingWindowLayer(sliding_window=config.sliding_window)
                  for index in range(config.num_hidden_layers)]
    except BaseException:
        runtime.close()
        raise
    runtime.layers = [layer for layer in layers if isinstance(layer, SelectiveLayer)]
    return SelectiveCache(layers, runtime)
