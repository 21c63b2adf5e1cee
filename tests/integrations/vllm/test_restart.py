"""A new vLLM process on the same flash file finds what the last one stored, even one killed by SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from kvtier.integrations.vllm.journal import RECORD_BYTES
from kvtier.integrations.vllm.config import flash_tier_entry
from vllm_chunks import QWEN25_BLOCK, chunk_bytes, job, key, primary_rows, wait_for_jobs

WRITER = Path(__file__).parents[2] / "vllm_writer.py"
CAPACITY = 256 * QWEN25_BLOCK


def found(vllm, tier, numbers):
    context = vllm.base.ReqContext("r")
    return [n for n in numbers if tier.lookup(key(vllm, n), context) is vllm.base.LookupResult.HIT]


def load_and_check(vllm, manager, numbers, job_id):
    """Load `numbers` 16 at a time into the CPU tier and compare every byte with what was stored."""
    tier, rows = manager.secondary_tiers[0], primary_rows(manager)
    for start in range(0, len(numbers), len(rows)):
        batch = numbers[start : start + len(rows)]
        rows[: len(batch)] = 0
        tier.submit_load(job(vllm, job_id + start, [key(vllm, n) for n in batch], list(range(len(batch))), True))
        assert wait_for_jobs(tier, {job_id + start})[job_id + start].success
        for row, number in enumerate(batch):
            np.testing.assert_array_equal(rows[row], chunk_bytes(number, QWEN25_BLOCK))


def test_chunks_stored_before_a_sigkill_are_found_and_load(make_manager, tmp_path, vllm):
    path, engine = tmp_path / "kv.flash", f"kvtier-test-{uuid.uuid4().hex[:12]}"
    writer = subprocess.Popen([sys.executable, str(WRITER), str(path), str(CAPACITY), "0", "64", engine],
                              stdout=subprocess.PIPE, text=True, env=os.environ | {"PYTHONWARNINGS": "ignore"})
    try:
        assert writer.stdout.readline().strip() == "stored", "the writer process died before storing"
        time.sleep(0.05)  # let it get into the next stores
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        writer.kill()
        Path(f"/dev/shm/vllm_offload_{engine}.mmap").unlink(missing_ok=True)  # vLLM's CPU tier, left by the kill
    assert writer.returncode == -signal.SIGKILL
    manager = make_manager([flash_tier_entry(path, CAPACITY)], block_bytes=QWEN25_BLOCK, cpu_chunks=16)
    tier = manager.secondary_tiers[0]
    assert found(vllm, tier, range(64)) == list(range(64))
    later = found(vllm, tier, range(64, 256))  # whatever else the killed process had completed
    assert later == list(range(64, 64 + len(later)))
    load_and_check(vllm, manager, list(range(64 + len(later))), job_id=0)


def test_a_torn_journal_tail_is_dropped_and_the_rest_found(make_manager, tmp_path, vllm):
    path = tmp_path / "kv.flash"
    first = make_manager([flash_tier_entry(path, CAPACITY)], block_bytes=QWEN25_BLOCK, cpu_chunks=16)
    tier, rows = first.secondary_tiers[0], primary_rows(first)
    for job_id in range(3):
        numbers = range(job_id * 16, job_id * 16 + 16)
        rows[:] = [chunk_bytes(n, QWEN25_BLOCK) for n in numbers]
        tier.submit_store(job(vllm, job_id, [key(vllm, n) for n in numbers], list(range(16)), False))
        assert wait_for_jobs(tier, {job_id})[job_id].success
    tier.shutdown()
    journal = path.with_name(path.name + ".index")
    size = journal.stat().st_size
    os.truncate(journal, size - RECORD_BYTES // 2)  # the last record half written, as after a power cut
    with open(journal, "ab") as file:
        file.write(b"\xff" * 40)
    second = make_manager([flash_tier_entry(path, CAPACITY)], block_bytes=QWEN25_BLOCK, cpu_chunks=16)
    tier = second.secondary_tiers[0]
    assert found(vllm, tier, range(48)) == list(range(47))  # the torn record's chunk is a miss
    assert tier.stats()["journal_torn_bytes_dropped"] == RECORD_BYTES // 2 + 40
    load_and_check(vllm, second, list(range(47)), job_id=100)
    rows = primary_rows(second)
    rows[0] = chunk_bytes(1000, QWEN25_BLOCK)  # new records follow the last good one
    tier.submit_store(job(vllm, 7, [key(vllm, 1000)], [0], False))
    assert wait_for_jobs(tier, {7})[7].success
    tier.shutdown()
    third = make_manager([flash_tier_entry(path, CAPACITY)], block_bytes=QWEN25_BLOCK, cpu_chunks=16)
    assert found(vllm, third.secondary_tiers[0], [*range(48), 1000]) == [*range(47), 1000]
