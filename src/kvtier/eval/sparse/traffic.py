"""Bytes a KV cache moved per decode step, per tier and direction, and how its files bypass the page cache.

Directions (bytes per decode step, all tiered layers and sequences together):

    storage->host     K/V read from the SSD to host memory: measured (the cache's I/O counters; for the
                      sparse cache, the cold pool's pages read)
    storage internal  sketches the sparse path's storage-side scorer reads next to the data: measured (disk
                      reads minus the host's page reads); the bytes HillInfer keeps off the host bus
    host->storage     writes (spills, demotions): measured
    host->device      K/V the step attends from the host/storage pool: measured selection counts for the
                      sparse cache; every pooled token for full offload; ceil(alpha x pool) for the
                      selective baselines (what they attend by construction); 0 for dense
    device->host      the token leaving the device window each step (one per layer and sequence): derived

On a CPU-only machine "device" and "host" are the same memory; the bytes are the copies the tiers make.
"""

from __future__ import annotations

import math

from kvtier.kv.contract import SparseView, TieredLayer
from kvtier.kv.dense import DenseCache
from kvtier.kv.model_geometry import model_geometry
from kvtier.kv.offload import OffloadCache

DIRECTIONS = ("storage->host", "storage internal", "host->storage", "host->device", "device->host")
O_DIRECT = "O_DIRECT"
BUFFERED = "none (the filesystem refused O_DIRECT: reads may hit the page cache)"


def cache_bypass(cache) -> str | None:
    """How the cache's reads avoid the page cache: O_DIRECT, a warning, or None without a disk tier."""
    files = cache.storage_files()
    if not files:
        return None
    return O_DIRECT if all(file.direct for file in files) else BUFFERED


def step_traffic(cache, model, measured: dict, alpha: float) -> dict[str, float]:
    """Bytes per decode step in each of DIRECTIONS, from a cache after `measure_decode` (before close)."""
    if isinstance(cache, DenseCache):
        return dict.fromkeys(DIRECTIONS, 0.0)
    layer_bytes = 2 * model_geometry(model).token_bytes_per_layer
    disk_read = measured["disk_read_bytes_per_step"]
    tiered = [layer for layer in cache.layers if isinstance(layer, TieredLayer) and layer.is_initialized]
    batch = tiered[0].keys.shape[0] if tiered else 0
    traffic = {"storage->host": disk_read, "storage internal": 0.0,
               "host->storage": measured["disk_written_bytes_per_step"],
               "device->host": float(len(tiered) * batch * layer_bytes)}
    sparse = cache.sparse_view()
    if sparse is not None:
        summary = sparse.step_summary()
        fetched = summary.get("cold_bytes_fetched", 0.0)
        attended = summary.get("selected_hot", 0.0) + summary.get("selected_cold", 0.0)
        traffic |= {"storage->host": fetched, "storage internal": max(0.0, disk_read - fetched)}
    else:
        pooled = [_pooled(layer) * batch for layer in tiered]
        attended = sum(pooled) if isinstance(cache, OffloadCache) else sum(math.ceil(alpha * n) for n in pooled)
    traffic["host->device"] = attended * layer_bytes
    return {direction: float(traffic[direction]) for direction in DIRECTIONS}


def _pooled(layer) -> int:
    """Tokens per sequence of a tiered layer outside the device window."""
    tokens = layer.tier_tokens()
    return tokens["host"] + tokens["storage"]


def sparse_details(sparse: SparseView) -> dict:
    """What the sparse path did per decode step: breakdown, selection, migration, and APP's plan vs measurement."""
    summary = sparse.step_summary()
    plan = sparse.plan
    pooled = summary.get("pooled_hot", 0.0) + summary.get("pooled_cold", 0.0)
    moves, ping_pongs = sparse.ping_pong()
    return {
        "breakdown_ms": {part: summary.get(f"{part}_s", 0.0) * 1000
                         for part in ("score", "fetch", "attention", "migrate", "rest")},
        "cold_selection_rate": summary.get("selected_cold", 0.0) / max(summary.get("pooled_cold", 0.0), 1),
        "hot_selection_rate": summary.get("selected_hot", 0.0) / max(summary.get("pooled_hot", 0.0), 1),
        "hot_share": summary.get("pooled_hot", 0.0) / max(pooled, 1),
        "cold_bytes_fetched_per_step": summary.get("cold_bytes_fetched", 0.0),
        # the selection's estimated attention mass kept (kvtier.sparse.mass), share of pooled tokens attended
        "mass_kept": summary.get("mass_kept", 0.0) / max(summary.get("mass_samples", 0.0), 1),
        "attended_share": (summary.get("selected_hot", 0.0) + summary.get("selected_cold", 0.0)) / max(pooled, 1),
        "guard_events_per_step": summary.get("guard_events", 0.0),
        "lookahead_layers_per_step": summary.get("lookahead_layers", 0.0),  # layers that took prefetched candidates
        "unpredicted_fetch_ms": summary.get("unpredicted_fetch_s", 0.0) * 1000,  # the fetch of the other layers
        "promotions_per_step": summary.get("promotions", 0.0),
        "demotions_per_step": summary.get("demotions", 0.0),
        "migrations": moves, "ping_pongs": ping_pongs, "ping_pong_rate": ping_pongs / moves if moves else 0.0,
        "predicted_ms": {"T_CPU": summary.get("predicted_host_s", 0.0) * 1000,
                         "T_storage": summary.get("predicted_storage_s", 0.0) * 1000},
        "measured_ms": {"T_CPU": summary.get("host_time_s", 0.0) * 1000,
                        "T_storage": summary.get("storage_time_s", 0.0) * 1000},
        # APP's estimate of the pools' selection rates next to the measured ones above
        "planned_selection_rates": {"hot": plan.alpha_host, "cold": plan.alpha_storage} if plan else None,
        "beta": plan.beta_for_json if plan else None,
        "capped_by_host_budget": plan.capped if plan else None,
        "hot_tokens": sparse.hot_tokens,
    }
