"""The cache contract: what every kvtier cache offers on top of transformers' `Cache`.

Each KV mode's cache (dense, offload, sparse, h2o, infinigen, leoam) subclasses `KVCache`; the
generation loop, the server and the evaluation talk to caches through it only. It is a cache's
counterpart of vLLM's `OffloadingManager`, LMCache's `StorageBackendInterface` and SGLang's
`HiCacheStorage`: an explicit interface rather than attributes probed at run time. A cache is a
context manager that closes itself.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

from kvtier.kv.model_geometry import model_geometry
from kvtier.storage import IOStats

TIERS = ("device", "host", "storage")


@runtime_checkable
class TieredLayer(Protocol):
    """A cache layer whose tokens are split over tiers (sliding-window and dense layers are not)."""

    def tier_tokens(self) -> dict[str, int]:
        """Tokens per sequence in each tier."""
        ...


@runtime_checkable
class KVCache(Protocol):
    """A transformers Cache of a kvtier KV mode."""

    def place_prompt(self) -> None:
        """End of prefill: a cache that tiers the prompt's KV only then (the sparse cache) does it now."""

    @abstractmethod
    def io_stats(self) -> IOStats:
        """Bytes read from and written to the cache's files so far (zeros for a cache without files)."""

    @abstractmethod
    def close(self) -> None:
        """Finish pending I/O, remove attention hooks, delete the cache's files."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


@runtime_checkable
class SelectiveKVCache(KVCache, Protocol):
    """A cache whose decode steps attend a chosen subset of the positions (sparse and the baselines)."""

    @abstractmethod
    def watch_attended(self, callback: Callable[[int, np.ndarray], None] | None) -> None:
        """Call `callback(layer_idx, positions [B, n])` with the positions each decode step attends (evaluation)."""


def tier_bytes(cache, model) -> dict[str, int]:
    """Bytes of K+V currently held in each tier, over all layers and sequences."""
    totals = dict.fromkeys(TIERS, 0)
    per_token_layer = 2 * model_geometry(model).token_bytes_per_layer
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        batch = layer.keys.shape[0]
        tokens = layer.tier_tokens() if isinstance(layer, TieredLayer) else {"device": layer.keys.shape[-2]}
        for tier, count in tokens.items():
            totals[tier] += count * batch * per_token_layer
    return totals
