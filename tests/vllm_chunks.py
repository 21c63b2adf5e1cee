"""Chunk sizes and chunk streams shared by the vLLM tier's tests."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np

# One 16-token bfloat16 KV block (K and V, every layer): 2 x layers x KV heads x head dim x 2 bytes x 16.
SMOLLM2_BLOCK = 2 * 30 * 3 * 64 * 2 * 16  # smollm2-135m: 368,640 bytes
QWEN25_BLOCK = 2 * 24 * 2 * 64 * 2 * 16  # qwen2.5-0.5b: 196,608 bytes


def vllm_api() -> Any:
    """The vLLM offloading modules the tests use, as one namespace."""
    from vllm.v1.kv_offload import base
    from vllm.v1.kv_offload.tiering import base as tiering
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    return type("VllmApi", (), {"base": base, "tiering": tiering, "Spec": TieringOffloadingSpec})


def key(vllm: Any, number: int, group: int = 0) -> bytes:
    """An OffloadKey as vLLM makes them: a 32-byte block hash plus the group index."""
    return vllm.base.make_offload_key(hashlib.sha256(number.to_bytes(8, "little")).digest(), group)


def chunk_bytes(number: int, size: int) -> np.ndarray:
    """The deterministic content of chunk `number` (so another process can check it)."""
    return np.random.default_rng(number).integers(0, 256, size, dtype=np.uint8)


def job(vllm: Any, job_id: int, keys: list[bytes], chunk_ids: list[int], promotion: bool) -> Any:
    return vllm.tiering.TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunk_ids, dtype=np.int32),
                                    is_promotion=promotion, req_context=vllm.base.ReqContext(req_id=f"req-{job_id}"))


def wait_for_jobs(tier: Any, job_ids: set[int], timeout: float = 30.0) -> dict[int, Any]:
    """Poll `tier.get_finished_jobs()` as vLLM does until every job in `job_ids` reported."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while set(results) != job_ids:
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs {sorted(job_ids - set(results))} never finished")
        for result in tier.get_finished_jobs():
            assert result.job_id not in results, f"job {result.job_id} reported twice"
            results[result.job_id] = result
        time.sleep(0.001)
    return results


def primary_rows(manager: Any) -> np.ndarray:
    """vLLM's CPU tier as a (chunks, bytes) uint8 array (the memory the secondary tier reads and fills)."""
    return np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)
