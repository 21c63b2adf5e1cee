"""KvtierFlashTier against vLLM's real offloading classes: the SecondaryTierManager contract.

The tier is built the way vLLM builds it (TieringOffloadingSpec -> SecondaryTierFactory with the
tier's `module_path`), over the CPU tier's real shared-memory region, and driven with vLLM's
TransferJob / JobResult types; one test runs the whole cascade and promotion path of vLLM's
TieringOffloadingManager.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from kvtier.errors import ConfigError, StorageError
from kvtier.integrations.vllm.config import flash_tier_entry
from vllm_chunks import QWEN25_BLOCK, SMOLLM2_BLOCK, chunk_bytes, job, key, primary_rows, wait_for_jobs


def store(vllm, manager, numbers, per_job=8, first_job=0):
    """Store chunks `numbers` (content chunk_bytes(n)) through the tier, a CPU-tier-full wave at a time."""
    tier, rows = manager.secondary_tiers[0], primary_rows(manager)
    results, job_id = {}, first_job
    for wave in range(0, len(numbers), len(rows)):
        ids = set()
        batch = numbers[wave : wave + len(rows)]
        for row, number in enumerate(batch):
            rows[row] = chunk_bytes(number, rows.shape[1])
        for start in range(0, len(batch), per_job):
            chunk_ids = list(range(start, min(start + per_job, len(batch))))
            tier.submit_store(job(vllm, job_id, [key(vllm, batch[c]) for c in chunk_ids], chunk_ids, False))
            ids.add(job_id)
            job_id += 1
        results |= wait_for_jobs(tier, ids)
    return results


def load(vllm, manager, numbers, job_id=10_000):
    """Load chunks `numbers` into CPU rows (reversed order, so no chunk lands where it was stored)."""
    tier, rows = manager.secondary_tiers[0], primary_rows(manager)
    chunk_ids = list(range(len(numbers)))[::-1]
    rows[chunk_ids] = 0
    tier.submit_load(job(vllm, job_id, [key(vllm, n) for n in numbers], chunk_ids, True))
    return wait_for_jobs(tier, {job_id})[job_id], {n: rows[c] for n, c in zip(numbers, chunk_ids)}


def test_the_config_line_builds_the_tier_through_vllms_factory(make_manager, tmp_path, vllm):
    from kvtier.integrations.vllm.tier import KvtierFlashTier  # here: without vLLM only these tests fail

    manager = make_manager([flash_tier_entry(tmp_path / "kv.flash", "32MiB")])
    tier = manager.secondary_tiers[0]
    assert isinstance(tier, KvtierFlashTier)
    assert tier.medium is vllm.base.Medium.STORAGE
    assert tier.store.file.num_slots == (32 << 20) // SMOLLM2_BLOCK
    assert tier.lookup(key(vllm, 1), vllm.base.ReqContext("r")) is vllm.base.LookupResult.MISS


@pytest.mark.parametrize("block_bytes", [4096, 3 * 4096 + 100, QWEN25_BLOCK, SMOLLM2_BLOCK])
def test_store_lookup_load_round_trips_are_byte_identical(make_manager, tmp_path, vllm, block_bytes):
    manager = make_manager([flash_tier_entry(tmp_path / "kv.flash", 200 * SMOLLM2_BLOCK)], block_bytes=block_bytes,
                           cpu_chunks=48)
    numbers = list(range(100, 190))
    stored = store(vllm, manager, numbers, per_job=5)
    assert all(result.success for result in stored.values())
    tier = manager.secondary_tiers[0]
    assert all(tier.lookup(key(vllm, n), vllm.base.ReqContext("r")) is vllm.base.LookupResult.HIT for n in numbers)
    for first in range(0, len(numbers), 30):
        result, loaded = load(vllm, manager, numbers[first : first + 30], job_id=first + 1000)
        assert result.success and result.successful_keys is None
        row_bytes = primary_rows(manager).shape[1]
        for number, row in loaded.items():
            np.testing.assert_array_equal(row, chunk_bytes(number, row_bytes))
    assert tier.stats()["sequential_share"] == 1.0


def test_a_flipped_byte_fails_the_load_and_the_chunk_is_not_served(make_manager, tmp_path, vllm):
    path = tmp_path / "kv.flash"
    manager = make_manager([flash_tier_entry(path, 64 * QWEN25_BLOCK)], block_bytes=QWEN25_BLOCK)
    store(vllm, manager, [1, 2, 3, 4])
    tier = manager.secondary_tiers[0]
    victim = tier.store.index.get(key(vllm, 3))
    with open(path, "r+b") as file:  # one bit of the chunk, as a bad flash page would
        file.seek(tier.store.file.offset(victim.slot) + 1234)
        byte = file.read(1)[0]
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte ^ 0x10]))
    result, loaded = load(vllm, manager, [1, 2, 3, 4])
    assert not result.success
    assert set(result.successful_keys) == {key(vllm, n) for n in (1, 2, 4)}
    for number in (1, 2, 4):
        np.testing.assert_array_equal(loaded[number], chunk_bytes(number, QWEN25_BLOCK))
    assert tier.lookup(key(vllm, 3), vllm.base.ReqContext("r")) is vllm.base.LookupResult.MISS
    assert tier.stats()["checksum_failures"] == 1


def test_vllms_tiering_manager_cascades_and_promotes_through_the_tier(make_manager, tmp_path, vllm):
    """GPU -> CPU store, cascade to the flash tier, CPU eviction, lookup -> promotion back, exact bytes."""
    manager = make_manager([flash_tier_entry(tmp_path / "kv.flash", 64 * QWEN25_BLOCK)], block_bytes=QWEN25_BLOCK,
                           cpu_chunks=8)
    base, rows = vllm.base, primary_rows(manager)
    step = base.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())

    def put_through_cpu(numbers, request):
        context = base.ReqContext(request)
        manager.on_new_request(context)
        keys = [key(vllm, n) for n in numbers]
        prepared = manager.prepare_store(keys, context)
        for number, chunk in zip(numbers, prepared.store_spec.block_ids):  # what vLLM's GPU worker copies
            rows[chunk] = chunk_bytes(number, QWEN25_BLOCK)
        manager.complete_store(keys, context)
        manager.on_request_finished(context)
        manager.secondary_tiers[0].drain_jobs()
        manager.on_schedule_end(step)

    put_through_cpu(list(range(8)), "first")
    put_through_cpu(list(range(8, 16)), "second")  # evicts the first eight from the 8-chunk CPU tier
    context = base.ReqContext("reader")
    manager.on_new_request(context)
    wanted = [key(vllm, n) for n in range(4)]
    assert [manager.lookup(k, context) for k in wanted] == [base.LookupResult.HIT_PENDING] * 4
    manager.on_schedule_end(step)  # submits the promotion job to the flash tier
    manager.secondary_tiers[0].drain_jobs()
    assert [manager.lookup(k, context) for k in wanted] == [base.LookupResult.HIT] * 4
    spec = manager.prepare_load(wanted, context)
    for number, chunk in zip(range(4), spec.block_ids):
        np.testing.assert_array_equal(rows[chunk], chunk_bytes(number, QWEN25_BLOCK))
    manager.complete_load(wanted, context)
    manager.on_request_finished(context)


def test_a_full_file_reclaims_the_oldest_segments_and_reports_their_chunks_missing(make_manager, tmp_path, vllm):
    manager = make_manager([flash_tier_entry(tmp_path / "kv.flash", 16 * QWEN25_BLOCK, segment_chunks=4)],
                           block_bytes=QWEN25_BLOCK, cpu_chunks=16)
    numbers = list(range(60))
    assert all(result.success for result in store(vllm, manager, numbers, per_job=3).values())
    tier, context = manager.secondary_tiers[0], vllm.base.ReqContext("r")
    hits = [n for n in numbers if tier.lookup(key(vllm, n), context) is vllm.base.LookupResult.HIT]
    assert 12 <= len(hits) <= 16 and hits == numbers[-len(hits):]  # the newest survive, oldest dropped
    result, loaded = load(vllm, manager, hits)
    assert result.success
    for number in hits:
        np.testing.assert_array_equal(loaded[number], chunk_bytes(number, QWEN25_BLOCK))
    missing, _ = load(vllm, manager, [0, hits[0]], job_id=20_000)
    assert not missing.success and missing.successful_keys == (key(vllm, hits[0]),)
    stats = tier.stats()
    assert stats["dropped_chunks"] == len(numbers) - len(hits)
    assert stats["sequential_share"] == 1.0 and stats["reclaimed_segments"] > 0 and stats["overwrites"] > 0


def test_concurrent_submits_from_several_threads(make_manager, tmp_path, vllm):
    manager = make_manager([flash_tier_entry(tmp_path / "kv.flash", 128 * QWEN25_BLOCK, io_threads=4)],
                           block_bytes=QWEN25_BLOCK, cpu_chunks=64)
    tier, rows = manager.secondary_tiers[0], primary_rows(manager)
    for row in range(64):
        rows[row] = chunk_bytes(row, QWEN25_BLOCK)
    barrier, errors = threading.Barrier(4), []

    def submitter(thread):
        try:
            barrier.wait()
            for step in range(4):  # 4 threads x 4 jobs of 4 chunks: rows 0..63, each once
                chunk_ids = [thread * 16 + step * 4 + c for c in range(4)]
                tier.submit_store(job(vllm, thread * 100 + step, [key(vllm, c) for c in chunk_ids], chunk_ids, False))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    results = wait_for_jobs(tier, {t * 100 + s for t in range(4) for s in range(4)})
    assert all(result.success for result in results.values())
    assert len(tier.store) == 64
    result, loaded = load(vllm, manager, list(range(64)))
    assert result.success
    for number, row in loaded.items():
        np.testing.assert_array_equal(row, chunk_bytes(number, QWEN25_BLOCK))


def test_drain_jobs_leaves_every_result_ready(make_manager, tmp_path, vllm):
    manager = make_manager([flash_tier_entry(tmp_path / "kv.flash", 64 * QWEN25_BLOCK)], block_bytes=QWEN25_BLOCK)
    tier = manager.secondary_tiers[0]
    for job_id in range(6):
        tier.submit_store(job(vllm, job_id, [key(vllm, job_id)], [job_id], False))
    assert tier.has_pending_work()
    tier.drain_jobs()
    assert sorted(result.job_id for result in tier.get_finished_jobs()) == list(range(6))
    assert not tier.has_pending_work()


def test_bad_paths_and_foreign_files_are_refused_and_left_untouched(make_manager, tmp_path, vllm):
    with pytest.raises(StorageError, match="does not exist"):
        make_manager([flash_tier_entry(tmp_path / "missing" / "kv.flash", "8MiB")])
    foreign = tmp_path / "notes.txt"
    foreign.write_bytes(b"precious" * 1000)
    with pytest.raises(StorageError, match="not a kvtier flash tier file"):
        make_manager([flash_tier_entry(foreign, "8MiB")])
    assert foreign.read_bytes() == b"precious" * 1000
    with pytest.raises(ConfigError, match="holds no chunk"):
        make_manager([flash_tier_entry(tmp_path / "tiny.flash", 4096)])


def test_a_file_of_another_model_or_in_use_is_refused(make_manager, tmp_path, vllm):
    path = tmp_path / "kv.flash"
    manager = make_manager([flash_tier_entry(path, 16 * QWEN25_BLOCK)], block_bytes=QWEN25_BLOCK)
    with pytest.raises(StorageError, match="in use by another process"):
        make_manager([flash_tier_entry(path, 16 * QWEN25_BLOCK)], block_bytes=QWEN25_BLOCK)
    manager.secondary_tiers[0].shutdown()
    with pytest.raises(ConfigError, match="model: 'smollm2-135m' there, 'qwen2.5-0.5b' here"):
        make_manager([flash_tier_entry(path, 16 * QWEN25_BLOCK)], block_bytes=QWEN25_BLOCK, model="qwen2.5-0.5b")
    with pytest.raises(ConfigError, match="chunks of 196608 bytes"):
        make_manager([flash_tier_entry(path, 16 * QWEN25_BLOCK)], block_bytes=SMOLLM2_BLOCK)
    os.truncate(path, 3 * 4096)
    with pytest.raises(StorageError, match="truncated"):
        make_manager([flash_tier_entry(path, 16 * QWEN25_BLOCK)], block_bytes=QWEN25_BLOCK)


def test_a_job_naming_chunks_outside_the_cpu_tier_fails_without_raising(make_manager, tmp_path, vllm):
    manager = make_manager([flash_tier_entry(tmp_path / "kv.flash", 64 * QWEN25_BLOCK)], block_bytes=QWEN25_BLOCK,
                           cpu_chunks=8)
    tier = manager.secondary_tiers[0]
    tier.submit_store(job(vllm, 1, [key(vllm, 1)], [8], False))
    tier.submit_load(job(vllm, 2, [key(vllm, 1), key(vllm, 2)], [0], True))
    results = wait_for_jobs(tier, {1, 2})
    assert not results[1].success and not results[2].success
    assert len(tier.store) == 0 and tier.store.stats()["chunks"] == 0
