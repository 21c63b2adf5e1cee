"""What a flash file's chunks depend on, from vLLM's offloading config: a file of another is refused."""

from __future__ import annotations

from typing import Any


def kv_identity(config: Any) -> dict[str, Any]:
    """Model, dtype, hashing, chunking, layer groups and parallel layout of an `OffloadingConfig`."""
    parallel = config.parallel
    return {
        "model": config.model.name,
        "dtype": str(config.model.dtype),
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [[group.tokens_per_block, list(group.layer_names)] for group in config.groups],
        "parallel": [parallel.tp_size, parallel.pp_size, parallel.pcp_size, parallel.dcp_size],
        "kv_cache_layout": config.kv_cache_layout,
        "canonical_layout": config.canonical_layout,
    }
