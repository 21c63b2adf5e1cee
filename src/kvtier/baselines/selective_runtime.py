"""What a baseline cache is built from and what its tiered layers share: setup, budgets, I/O engine, block stores.

Budgets follow every other KV mode (kvtier.kv.budget): bytes over all tiered
layers and all sequences. The device must hold the sink + recent window of
every tiered layer (the tokens always attended, as in --kv sparse); the host
budget first pays for what the baseline itself keeps in DRAM (InfiniGen's
partial key cache, LeoAM's abstract write buffer), and the rest holds pooled
K/V in whole blocks. Everything else is on disk.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.baselines.selective_store import SelectiveStore
from kvtier.errors import ConfigError, setting
from kvtier.kv.budget import TierCapacity, tier_capacity
from kvtier.sparse import SparseSettings
from kvtier.storage import BlockLayout, IOEngine, IOStats, KVBlockFile, KVGeometry
from kvtier.units import format_size

@dataclass(frozen=True)
class TierSetup:
    """A KVConfig resolved for one cache (kvtier.modes builds it)."""

    settings: SparseSettings  # alpha, sink and recent: the same as the sparse path's, so every mode attends alike
    max_tokens: int
    batch_size: int
    storage_dir: Path
    device_budget: int
    host_budget: int
    tiered_layers: tuple[int, ...]
    block_tokens: int = 64
    io_threads: int = 8
    model_id: str = "model"


def pages_fill_blocks(geometry: KVGeometry, block_tokens: int) -> bool:
    """Whether blocks fill whole pages, so a store can read the pages of chosen tokens only (store.py)."""
    return BlockLayout(geometry, block_tokens, num_blocks=1).fills_pages


def plan_capacity(setup: TierSetup, geometry: KVGeometry, host_reserved: int = 0,
                  reserved_for: str = "") -> TierCapacity:
    """Token capacities per layer and sequence; `host_reserved` bytes of the host budget go to `reserved_for`."""
    window = setup.settings.sink + setup.settings.recent
    per_token = geometry.token_bytes * setup.batch_size
    if window * per_token > setup.device_budget:
        raise ConfigError(f"device KV budget {format_size(setup.device_budget)} cannot hold the sink + recent window "
                          f"({window} tokens = {format_size(window * per_token)}); raise {setting('device_kv_budget')} "
                          f"or lower {setting('sink')} / {setting('recent')}")
    if host_reserved > setup.host_budget:
        raise ConfigError(f"host KV budget {format_size(setup.host_budget)} cannot hold {reserved_for} "
                          f"({format_size(host_reserved)}); raise {setting('host_kv_budget')}")
    host_kv = setup.host_budget - host_reserved
    if host_reserved and host_kv < per_token * setup.block_tokens:
        host_kv = 0  # the reserve took (nearly) all of it: no host KV tier
    return tier_capacity(setup.device_budget, host_kv, geometry.token_bytes, setup.block_tokens, setup.batch_size)


class SelectiveRuntime:
    """Shared by the tiered layers of one baseline cache: settings, capacities, the I/O engine and block stores."""

    def __init__(self, setup: TierSetup, geometry: KVGeometry, capacity: TierCapacity, buffers: int = 1,
                 extra_stores: dict[str, int] | None = None) -> None:
        self.setup = setup
        self.settings = setup.settings
        self.geometry = geometry
        self.capacity = capacity
        self.io = IOEngine(setup.io_threads)
        self.stores: list[SelectiveStore] = []
        self.layers: list = []  # the tiered SelectiveLayers in model order (set by the builder)
        self.hooks: list = []  # removable torch hooks a baseline registered on the model
        self.on_attend: Callable[[int, np.ndarray], None] | None = None  # see SelectiveCache.watch_attended
        try:
            self.kv = self.open_store("kv", setup.max_tokens, buffers)
            self.extra = {name: self.open_store(name, rows) for name, rows in (extra_stores or {}).items()}
        except BaseException:
            self.close()
            raise

    def open_store(self, name: str, tokens_per_seq: int, buffers: int = 1) -> SelectiveStore:
        """A new block file in the storage dir: `tokens_per_seq` rows (tokens, abstracts) per layer and sequence."""
        setup = self.setup
        blocks = -(-tokens_per_seq // setup.block_tokens)
        path = setup.storage_dir / f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}.kvt"
        file = KVBlockFile.create(path, self.geometry, setup.block_tokens, blocks * setup.batch_size, setup.model_id,
                                  io=self.io, page_checksums=pages_fill_blocks(self.geometry, setup.block_tokens))
        tier_of_layer = {layer: tier for tier, layer in enumerate(setup.tiered_layers)}
        store = SelectiveStore(file, tier_of_layer, setup.batch_size, buffers)
        self.stores.append(store)
        return store

    def following(self, layer):
        """The tiered layer that runs after `layer` (the first one again after the last)."""
        return self.layers[(self.layers.index(layer) + 1) % len(self.layers)]

    def io_stats(self) -> IOStats:
        """Bytes read from and written to this cache's files so far."""
        return self.io.stats.snapshot()

    def close(self) -> None:
        """Remove hooks, finish I/O, delete the files."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        for store in self.stores:
            store.close()
        self.stores = []
        self.io.close()
