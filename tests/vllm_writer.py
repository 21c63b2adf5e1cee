"""A vLLM process that stores chunks through the kvtier flash tier and is then killed (restart tests).

    python vllm_writer.py PATH CAPACITY FIRST COUNT ENGINE_ID

Stores chunks FIRST..FIRST+COUNT-1 (content vllm_chunks.chunk_bytes), prints "stored" once every
job has reported success, then goes on storing further chunks (never so many that the log would
reclaim the first ones) and waits to be killed.
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from kvtier.integrations.vllm.config import flash_tier_entry, tiering_manager  # noqa: E402
from vllm_chunks import QWEN25_BLOCK, chunk_bytes, job, key, primary_rows, vllm_api, wait_for_jobs  # noqa: E402


def main(path: str, capacity: int, first: int, count: int, engine_id: str) -> None:
    vllm = vllm_api()
    manager = tiering_manager(QWEN25_BLOCK, 16, [flash_tier_entry(path, capacity)], engine_id=engine_id)
    tier, rows = manager.secondary_tiers[0], primary_rows(manager)
    numbers = itertools.count(first)
    for job_id in range((tier.store.file.num_slots - tier.store.log.segment_slots) // len(rows)):
        batch = [next(numbers) for _ in range(len(rows))]
        for row, number in enumerate(batch):
            rows[row] = chunk_bytes(number, QWEN25_BLOCK)
        tier.submit_store(job(vllm, job_id, [key(vllm, n) for n in batch], list(range(len(rows))), False))
        assert wait_for_jobs(tier, {job_id})[job_id].success
        if batch[-1] == first + count - 1:
            print("stored", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
