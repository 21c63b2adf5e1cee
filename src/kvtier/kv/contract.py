"""The cache contract: what every kvtier cache offers on top of transformers' `Cache`.

Each KV mode's cache (dense, offload, sparse, h2o, infinigen, leoam) subclasses `KVCache`; the
generation loop, the server and the evaluation talk to caches through it only. It is a cache's
counterpart of vLLM's `OffloadingManager`, LMCache's `StorageBackendInterface` and SGLang's
`HiCacheStorage`: an explicit interface rather than attributes probed at run time. A cache is a
context manager that closes itself.

What only some modes have (a disk tier's files, a stored prefix read in place, the sparse path's scorer and
per-step record) is on the contract too, answered by default with a neutral value (no files, nothing stored,
0 restarts, no sparse view), so that callers never ask which mode a cache is.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from kvtier.errors import StorageError
from kvtier.kv.model_geometry import model_geometry
from kvtier.storage import IOStats

TIERS = ("device", "host", "storage")


@runtime_checkable
class TieredLayer(Protocol):
    """A cache layer whose tokens are split over tiers (sliding-window and dense layers are not)."""

    def tier_tokens(self) -> dict[str, int]:
        """Tokens per sequence in each tier."""
        ...


class DiskFile(Protocol):
    """A file of a cache's disk tier."""

    direct: bool  # opened with O_DIRECT: its reads bypass the page cache


class StoredInPlace(Protocol):
    """A document KV store entry's files that a cache reads where they lie instead of copying them into its own
    (the sparse tiers stored with the entry, or offload's stored K/V)."""

    bytes_read: int  # when the cache opened them (tables, checksums); their records are read per step

    def holds(self, error: StorageError) -> bool:
        """Whether `error` is about one of these files (storage errors name their file first)."""


class SplitPlan(Protocol):
    """APP's split of the sparse cache's pool between hot and cold (kvtier.sparse.planner.Plan)."""

    @property
    def hot_tokens(self) -> int: ...

    @property
    def alpha_host(self) -> float: ...  # the hot pool's expected selection rate

    @property
    def alpha_storage(self) -> float: ...  # the cold pool's

    @property
    def capped(self) -> bool: ...  # the hot pool was limited by the host budget

    @property
    def beta_for_json(self) -> float | str: ...  # hot:cold ratio, "inf" when everything is hot


class SparseView(Protocol):
    """What only the sparse cache keeps, for the evaluation's breakdowns: its per-step record, APP's plan, the
    scorer's health (kvtier.sparse.SparseCache)."""

    @property
    def plan(self) -> SplitPlan | None:
        """None until the first tiered layer is placed."""

    @property
    def hot_tokens(self) -> int:
        """Planned hot-pool size per layer and sequence (0 before the first layer is placed)."""

    @property
    def io_backend(self) -> str:
        """How the cold reads reach the disk: kernel AIO or the thread pool."""

    @property
    def scorer_host_fallbacks(self) -> int:
        """Scorer requests (partly) scored on the host after a fault."""

    def step_summary(self) -> dict[str, float]:
        """Mean per decode step of every recorded field (seconds, tokens, bytes) over the steps after the first."""

    def ping_pong(self) -> tuple[int, int]:
        """(moves, ping-pong moves) summed over the tiered layers."""

    def scorer_round_trip_s(self, repeats: int) -> float:
        """Median seconds of an empty scorer request, over `repeats` (between decode steps only)."""


@runtime_checkable
class KVCache(Protocol):
    """A transformers Cache of a kvtier KV mode."""

    def place_prompt(self) -> None:
        """End of prefill: a cache that tiers the prompt's KV only then (the sparse cache) does it now."""

    def storage_files(self) -> list[DiskFile]:
        """The files of the cache's disk tier (none without one)."""
        return []

    def scorer_restarts(self) -> int:
        """Times the cache's storage scorer process was restarted so far (0 without one)."""
        return 0

    def attention_budget(self) -> dict[str, float | int | None] | None:
        """What its sparse selection kept so far, per request (the sparse cache's `mass_kept_mean`, `mass_kept_min`,
        `attended_share`, `guard_events`); None for a mode that attends every token or does not estimate it."""
        return None

    def stored_in_place(self) -> StoredInPlace | None:
        """The document store entry's files the cache reads in place (built on a stored prefix), if any."""
        return None

    def save_placed(self, entry_dir: Path, tokens: int) -> None:
        """After `place_prompt`: add how the cache placed positions < `tokens` to the document store entry being
        written in `entry_dir`, for a later run to use in place (the sparse cache's tiers); nothing by default.
        Raises OSError when a write fails."""

    def sparse_view(self) -> SparseView | None:
        """The sparse path's own record and health (None for every other mode)."""
        return None

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
