"""`kvtier bench vllm-tier`: kvtier's flash tier vs vLLM's own `fs` tier, through vLLM's SecondaryTierManager.

Both tiers are built by vLLM's TieringOffloadingSpec (the same CPU tier, the same config but the
`secondary_tiers` entry), in the same directory on the same disk, and get the same chunk stream:
jobs of `chunks_per_job` chunks (a request's worth of 16-token blocks) from the CPU tier's rows,
at most `window` jobs in flight, completion observed by polling `get_finished_jobs` every
POLL_S as vLLM's scheduler does. Per tier and repeat (alternating which tier goes first):

- store: every chunk once; then the files' cached pages are dropped (both tiers write with
  O_DIRECT where the filesystem allows it, recorded per tier);
- load: every chunk once, into other CPU rows, job by job as they were stored but the jobs in a
  shuffled order (requests return in another order); then a sample is compared byte for byte
  with what was stored (untimed);
- GB/s over the phase's wall time, p50/p99 of the per-job latency (submit -> seen finished),
  files created, the log's sequential share and logical overwrites (kvtier; vLLM's fs tier
  writes one new file per chunk and leaves placement to the filesystem), and for both the
  physical sequential share: where the filesystem put each chunk (FIEMAP), in submission order.

Restart: `restart_chunks` 4 KiB chunks are stored once per tier, then a new tier is started on the
same files `repeats` times and timed until every chunk has been looked up as a hit (kvtier: replay
of its journal, read after its cached pages were dropped; fs: vLLM's asynchronous existence checks,
against warm dentry caches, which a shared machine does not let us drop).
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.eval.record import spread
from kvtier.integrations.vllm.config import flash_tier_entry, tiering_manager
from kvtier.integrations.vllm.placement import physical_sequential_share
from kvtier.storage import drop_page_cache

POLL_S = 0.001
# One 16-token bfloat16 block (K and V of every layer) of each model: 2 x layers x KV heads x head dim x 2 x 16.
MODEL_BLOCKS = {"smollm2-135m": 2 * 30 * 3 * 64 * 2 * 16, "qwen2.5-0.5b": 2 * 24 * 2 * 64 * 2 * 16}
RESTART_BLOCK = 4096
TIERS = ("kvtier", "fs")


def tier_entry(tier: str, directory: Path, capacity: int, io_threads: int) -> dict[str, Any]:
    if tier == "kvtier":
        return flash_tier_entry(directory / "kv.flash", capacity, io_threads=io_threads)
    return {"type": "fs", "root_dir": str(directory / "fs"), "n_read_threads": io_threads,
            "n_write_threads": io_threads}


class TierRun:
    """One tier behind a fresh vLLM TieringOffloadingManager, driven job by job."""

    def __init__(self, tier: str, directory: Path, block_bytes: int, chunks: int, cpu_chunks: int, io_threads: int,
                 model: str) -> None:
        self.name, self.directory = tier, directory
        self.manager = tiering_manager(block_bytes, cpu_chunks, [tier_entry(tier, directory, chunks * block_bytes,
                                                                             io_threads)], model=model)
        self.tier = self.manager.secondary_tiers[0]
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key
        from vllm.v1.kv_offload.tiering.base import TransferJob

        self._job, self._context = TransferJob, ReqContext("bench")
        self._key = lambda number: make_offload_key(number.to_bytes(8, "little") * 4, 0)
        self._next_id = 0
        self.row_of: dict[int, int] = {}  # the CPU row each chunk was stored from

    def transfer(self, numbers: list[int], first_row: int, per_job: int, window: int,
                 promotion: bool) -> dict[str, Any]:
        """Move chunks `numbers` in jobs of `per_job`, at most `window` in flight, each job on its own CPU rows
        (the `window` groups of `per_job` rows from `first_row`); wall time and per-job latencies."""
        jobs = [numbers[start : start + per_job] for start in range(0, len(numbers), per_job)]
        free = list(range(window))  # row groups no job in flight uses
        submitted: dict[int, tuple[float, int]] = {}
        latencies, failed, started = [], 0, time.perf_counter()
        for chunk_numbers in jobs:
            while not free:
                failed += self._poll(submitted, latencies, free)
            group, job_id = free.pop(), self._next_id
            self._next_id += 1
            rows = [first_row + group * per_job + offset for offset in range(len(chunk_numbers))]
            if not promotion:
                self.row_of.update(zip(chunk_numbers, rows))
            submitted[job_id] = (time.perf_counter(), group)
            job = self._job(job_id=job_id, keys=[self._key(n) for n in chunk_numbers],
                            chunk_ids=np.array(rows, dtype=np.int32), is_promotion=promotion,
                            req_context=self._context)
            (self.tier.submit_load if promotion else self.tier.submit_store)(job)
        while submitted:
            failed += self._poll(submitted, latencies, free)
        wall = time.perf_counter() - started
        moved = len(numbers) * self.tier.block_size_bytes
        return {"seconds": wall, "bytes": moved, "gb_per_s": moved / wall / 1e9, "jobs": len(jobs),
                "failed_jobs": failed, "job_p50_ms": 1e3 * float(np.percentile(latencies, 50)),
                "job_p99_ms": 1e3 * float(np.percentile(latencies, 99))}

    def _poll(self, submitted: dict[int, tuple[float, int]], latencies: list[float], free: list[int]) -> int:
        time.sleep(POLL_S)
        failed = 0
        for result in self.tier.get_finished_jobs():
            started, group = submitted.pop(result.job_id)
            latencies.append(time.perf_counter() - started)
            free.append(group)
            failed += not result.success
        return failed

    def lookup_all(self, numbers: list[int]) -> int:
        """Look every chunk up until none answers RETRY (vLLM's fs tier checks asynchronously); the hits."""
        from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext

        pending, hits = list(numbers), 0
        while pending:
            answers = [self.tier.lookup(self._key(n), self._context) for n in pending]
            hits += sum(answer is LookupResult.HIT for answer in answers)
            pending = [n for n, answer in zip(pending, answers) if answer is LookupResult.RETRY]
            if pending:
                self.tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
                time.sleep(POLL_S)
        return hits

    def files(self) -> list[Path]:
        return [Path(root) / name for root, _, names in os.walk(self.directory) for name in names]

    def direct(self) -> bool:
        return self.tier.store.file.direct if self.name == "kvtier" else bool(self.tier._use_o_direct)

    def drop_cached_pages(self) -> None:
        for path in self.files():
            fd = os.open(path, os.O_RDONLY)
            try:
                drop_page_cache(fd)
            finally:
                os.close(fd)

    def physical_share(self, numbers: list[int]) -> float | None:
        """The physical sequential share (FIEMAP) of the chunks' writes, in the order they were submitted."""
        size = self.tier.block_size_bytes
        if self.name == "kvtier":
            file = self.tier.store.file
            writes = [(file.path, file.offset(self.tier.store.index.get(self._key(n)).slot), size) for n in numbers]
        else:
            writes = [(Path(self.tier.file_mapper.get_file_name(self._key(n))), 0, size) for n in numbers]
        return physical_sequential_share(writes)

    def log_stats(self) -> dict[str, Any]:
        if self.name != "kvtier":
            return {"sequential_share": None, "overwrites": None}
        stats = self.tier.stats()
        return {name: stats[name] for name in ("sequential_share", "overwrites", "appends", "reclaimed_segments")}

    def close(self) -> None:
        del self.rows
        self.manager.shutdown()


def throughput_run(tier: str, directory: Path, model: str, total_bytes: int, per_job: int, window: int,
                   io_threads: int, seed: int) -> dict[str, Any]:
    """Store then load `total_bytes` of `model`'s chunks through `tier`, in a fresh directory."""
    block = MODEL_BLOCKS[model]
    chunks = max(per_job, total_bytes // block)
    half = window * per_job  # rows [0, half) are the store sources, [half, 2 half) the load targets
    run = TierRun(tier, directory, block, chunks + per_job, 2 * half, io_threads, model)
    try:
        run.rows[:half] = np.random.default_rng(seed).integers(0, 256, (half, run.rows.shape[1]), dtype=np.uint8)
        numbers = list(range(chunks))
        stored = run.transfer(numbers, 0, per_job, window, promotion=False)
        physical = run.physical_share(numbers)
        run.drop_cached_pages()
        jobs = [numbers[start : start + per_job] for start in range(0, chunks, per_job)]
        random.Random(seed).shuffle(jobs)  # requests come back in another order, each for its own chunks
        loaded = run.transfer([n for job in jobs for n in job], half, per_job, window, promotion=True)
        return {"store": stored, "load": loaded, "files_created": len(run.files()), "direct": run.direct(),
                "physical_sequential_share": physical,
                "verified_chunks": _verify(run, numbers, per_job, half)} | run.log_stats()
    finally:
        run.close()


def _verify(run: TierRun, numbers: list[int], per_job: int, first_row: int) -> int:
    """Load a sample of chunks once more and compare them byte for byte with their source rows (untimed)."""
    sample = numbers[:: max(1, len(numbers) // per_job)][:per_job]
    run.rows[first_row : first_row + len(sample)] = 0
    if run.transfer(sample, first_row, per_job, 1, promotion=True)["failed_jobs"]:
        raise AssertionError(f"{run.name}: the verification load failed")
    for offset, number in enumerate(sample):
        if not np.array_equal(run.rows[first_row + offset], run.rows[run.row_of[number]]):
            raise AssertionError(f"{run.name}: chunk {number} came back different")
    return len(sample)


def restart_run(directory: Path, restart_chunks: int, repeats: int, io_threads: int,
                say: Callable[[str], None]) -> dict[str, Any]:
    """Store `restart_chunks` small chunks per tier once, then time fresh tiers finding them all."""
    per_job, window = 64, 4
    times: dict[str, list[float]] = {tier: [] for tier in TIERS}
    hits: dict[str, int] = {}
    for tier in TIERS:
        (directory / tier).mkdir(parents=True)
        run = TierRun(tier, directory / tier, RESTART_BLOCK, restart_chunks + per_job, 2 * window * per_job,
                      io_threads, "restart-4k")
        stored = run.transfer(list(range(restart_chunks)), 0, per_job, window, promotion=False)
        run.close()
        say(f"[bench vllm-tier] restart: {tier} stored {restart_chunks} chunks in {stored['seconds']:.1f} s")
    for repeat in range(repeats):
        for tier in TIERS if repeat % 2 == 0 else TIERS[::-1]:
            for path in (directory / tier).glob("kv.flash*"):
                _drop(path)
            started = time.perf_counter()
            run = TierRun(tier, directory / tier, RESTART_BLOCK, restart_chunks + per_job, 8, io_threads,
                          "restart-4k")
            hits[tier] = run.lookup_all(list(range(restart_chunks)))
            times[tier].append(time.perf_counter() - started)
            run.close()
    return {"chunks": restart_chunks, "chunk_bytes": RESTART_BLOCK, "hits": hits,
            "seconds": {tier: spread(values) for tier, values in times.items()}}


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        drop_page_cache(fd)
    finally:
        os.close(fd)


def run_vllm_tier_benchmark(directory: Path, models: list[str], total_bytes: int, per_job: int, window: int,
                            repeats: int, io_threads: int, restart_chunks: int,
                            say: Callable[[str], None]) -> dict[str, Any]:
    """Every model x tier x repeat (alternating order), then the restart test; one result dict."""
    results: dict[str, Any] = {}
    for model in models:
        runs: dict[str, list[dict[str, Any]]] = {tier: [] for tier in TIERS}
        for repeat in range(repeats):
            for tier in TIERS if repeat % 2 == 0 else TIERS[::-1]:
                place = directory / f"{model}-{tier}-{repeat}"
                place.mkdir(parents=True)
                try:
                    row = throughput_run(tier, place, model, total_bytes, per_job, window, io_threads, seed=repeat)
                finally:
                    shutil.rmtree(place, ignore_errors=True)
                runs[tier].append(row)
                say(f"[bench vllm-tier] {model} {tier} #{repeat}: store {row['store']['gb_per_s']:.2f} GB/s, "
                    f"load {row['load']['gb_per_s']:.2f} GB/s")
        results[model] = {"chunk_bytes": MODEL_BLOCKS[model], "tiers": {tier: _summary(rows) for tier, rows in
                                                                         runs.items()}}
    restart_dir = directory / "restart"
    try:
        restart = restart_run(restart_dir, restart_chunks, repeats, io_threads, say)
    finally:
        shutil.rmtree(restart_dir, ignore_errors=True)
    return {"models": results, "restart": restart, "fs_native_io": fs_native_io()}


def fs_native_io() -> bool:
    """Whether vLLM's fs tier runs its C I/O extension here (it links CUDA libraries) or its Python fallback."""
    from vllm.v1.kv_offload.tiering.fs import io

    return bool(io._HAS_FSIO_C)


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians with spread of the measured numbers, the counts of the first run, and every run."""
    measured = {f"{phase}_{name}": spread([row[phase][name] for row in rows])
                for phase in ("store", "load") for name in ("gb_per_s", "job_p50_ms", "job_p99_ms")}
    first = rows[0]
    counts = {name: first[name] for name in ("files_created", "direct", "sequential_share", "overwrites")}
    shares = [row["physical_sequential_share"] for row in rows if row["physical_sequential_share"] is not None]
    counts["physical_sequential_share"] = spread(shares) if shares else None
    failed = sum(row[phase]["failed_jobs"] for row in rows for phase in ("store", "load"))
    return measured | counts | {"failed_jobs": failed, "runs": rows,
                                "verified_chunks": sum(row["verified_chunks"] for row in rows),
                                "bytes_per_run": first["store"]["bytes"], "jobs_per_run": first["store"]["jobs"]}

