"""The configuration vLLM hands its offloading connector, for a one-group model (benchmark, tests), and
the secondary-tier entry that enables kvtier's flash tier."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

TIER_MODULE = "kvtier.integrations.vllm.tier"


def flash_tier_entry(path: str | Path, capacity: int | str, **options: Any) -> dict[str, Any]:
    """The `secondary_tiers` entry of kv_connector_extra_config that puts kvtier's flash tier behind vLLM's CPU tier."""
    return {"type": "KvtierFlashTier", "module_path": TIER_MODULE, "path": str(path), "capacity": capacity} | options


def offloading_config(block_bytes: int, cpu_chunks: int, tiers: list[dict[str, Any]], model: str = "smollm2-135m",
                      engine_id: str | None = None) -> Any:
    """vLLM's OffloadingConfig for one KV group of 16-token blocks of `block_bytes`, one block per chunk,
    a CPU tier of `cpu_chunks` chunks and the given secondary tiers (what the connector builds from a
    --kv-transfer-config on a single GPU)."""
    from vllm.v1.kv_offload import config

    return config.OffloadingConfig(
        groups=(config.OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers",), group_id=0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": cpu_chunks * block_bytes, "secondary_tiers": tiers},
        engine_id=engine_id or f"kvtier-{uuid.uuid4().hex[:12]}",
        model=config.OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=config.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=config.OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                                 data_parallel_index=0, data_parallel_size=1,
                                                 data_parallel_rank_local=None, is_parallelism_agnostic=True),
    )


def tiering_manager(block_bytes: int, cpu_chunks: int, tiers: list[dict[str, Any]], **options: Any) -> Any:
    """vLLM's TieringOffloadingManager (CPU tier + `tiers`), built by its TieringOffloadingSpec as the connector does."""
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    return TieringOffloadingSpec(offloading_config(block_bytes, cpu_chunks, tiers, **options)).get_manager()
