"""`KvtierFlashTier`: kvtier's HiFC flash log as a secondary tier of vLLM's tiering offload connector.

vLLM moves KV GPU -> CPU (its primary tier) and cascades every chunk stored there to its secondary
tiers; a lookup that misses the CPU tier asks them and promotes a hit back into a CPU slot. This
tier keeps vLLM's contract on top of `FlashChunkStore`:

- submit_store / submit_load return at once; the I/O and the checks run on kvtier's I/O threads,
  and `get_finished_jobs` hands out the finished jobs when vLLM polls;
- a failed job is reported failed (a load names the keys that did load, `successful_keys`): a
  chunk whose bytes do not match their crc32c never becomes visible to vLLM;
- lookups are answered from the in-memory index, which the journal rebuilds on restart.

Enable it with (in `--kv-transfer-config`, see docs/vllm.md):
    {"type": "KvtierFlashTier", "module_path": "kvtier.integrations.vllm.tier",
     "path": "/mnt/nvme/kvtier.flash", "capacity": "64GiB"}
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult, RequestOffloadingContext, SecondaryTierManager, TransferJob

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.chunk_store import FlashChunkStore, LoadOutcome
from kvtier.integrations.vllm.identity import kv_identity
from kvtier.storage import PAGE
from kvtier.storage.aligned import address_of
from kvtier.storage.flash_log import DEFAULT_SEGMENT_SLOTS
from kvtier.units import parse_size

log = logging.getLogger(__name__)


class KvtierFlashTier(SecondaryTierManager):
    """Secondary tier on one pre-allocated flash file, written append-only, every chunk checksummed."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str, path: str,
                 capacity: str | int, io_threads: int = 16, segment_chunks: int = DEFAULT_SEGMENT_SLOTS,
                 fsync: bool = False, locality: str | None = None, backpressure_detector: Any = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self._rows = primary_kv_view.cast("B")
        try:
            if self._rows.nbytes and (self.block_size_bytes % PAGE or address_of(self._rows) % PAGE):
                raise ConfigError(f"vLLM's CPU tier rows ({self.block_size_bytes} bytes) are not {PAGE}-byte "
                                  "aligned; the flash tier moves them with O_DIRECT")
            self.store = FlashChunkStore(path, self.block_size_bytes, parse_size(capacity),
                                         kv_identity(offloading_spec.config), io_threads, segment_chunks, fsync)
        except BaseException:
            self._rows.release()  # vLLM unmaps its CPU tier when a tier fails to start
            raise
        self._finished: deque[JobResult] = deque()
        self._outstanding = 0
        self._reported = threading.Condition()
        log.info("kvtier flash tier at %s: %d of %d chunks found (%.3f s), %s", path, len(self.store),
                 self.store.file.num_slots, self.store.recovery_s, "O_DIRECT" if self.store.file.direct else "buffered")

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self.store else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._report(job_metadata, self._submit(self.store.store, job_metadata), self._stored)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._report(job_metadata, self._submit(self.store.load, job_metadata), self._loaded)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        while self._finished:
            results.append(self._finished.popleft())
        return results

    def has_pending_work(self) -> bool:
        return self._outstanding > 0 or bool(self._finished)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        with self._reported:
            self._reported.wait_for(lambda: self._outstanding == 0)

    def shutdown(self) -> None:
        self.drain_jobs()
        self.store.close()
        self._rows.release()
        # Finished I/O futures sit in reference cycles (their callbacks) that still hold slices of vLLM's
        # CPU-tier memory; collect them now, as vLLM unmaps that memory right after this returns.
        gc.collect()

    def stats(self) -> dict[str, Any]:
        """The flash log's counters (appends, sequential share, overwrites, reclaimed segments, ...)."""
        return self.store.stats()

    def _primary_rows(self, job: TransferJob) -> list[memoryview]:
        size, count = self.block_size_bytes, self._rows.nbytes // self.block_size_bytes
        if len(job.chunk_ids) != len(job.keys) or any(not 0 <= int(chunk) < count for chunk in job.chunk_ids):
            raise ValueError(f"job {job.job_id}: {len(job.keys)} keys for CPU-tier chunks {list(job.chunk_ids)} "
                             f"(the CPU tier has {count})")
        return [self._rows[int(chunk) * size : (int(chunk) + 1) * size] for chunk in job.chunk_ids]

    def _submit(self, action: Any, job: TransferJob) -> Future[Any]:
        """`action`'s future for the job; never raises into vLLM's scheduler (an error fails the job)."""
        try:
            return action(list(job.keys), self._primary_rows(job))
        except Exception as error:
            failed: Future[Any] = Future()
            failed.set_exception(error)
            return failed

    def _report(self, job: TransferJob, future: Future[Any], result_of: Any) -> None:
        with self._reported:
            self._outstanding += 1
        started = time.monotonic()

        def on_done(done: Future[Any]) -> None:
            result = result_of(job, done)
            result.transfer_time = time.monotonic() - started
            with self._reported:
                self._finished.append(result)
                self._outstanding -= 1
                self._reported.notify_all()

        future.add_done_callback(on_done)

    def _stored(self, job: TransferJob, done: Future[list[bytes]]) -> JobResult:
        if done.exception() is not None:
            log.warning("kvtier flash tier: store job %d failed: %s", job.job_id, done.exception())
            return JobResult(job_id=job.job_id, success=False)
        return JobResult(job_id=job.job_id, success=True, transfer_bytes=len(done.result()) * self.block_size_bytes)

    def _loaded(self, job: TransferJob, done: Future[LoadOutcome]) -> JobResult:
        if done.exception() is not None:
            log.warning("kvtier flash tier: load job %d failed: %s", job.job_id, done.exception())
            return JobResult(job_id=job.job_id, success=False)
        outcome = done.result()
        moved = len(outcome.loaded) * self.block_size_bytes
        if not outcome.failed:
            return JobResult(job_id=job.job_id, success=True, transfer_bytes=moved)
        log.warning("kvtier flash tier: load job %d: %d of %d chunks not served (%s)", job.job_id,
                    len(outcome.failed), len(job.keys), next(iter(outcome.failed.values())))
        return JobResult(job_id=job.job_id, success=False, transfer_bytes=moved,
                         successful_keys=tuple(outcome.loaded) if outcome.loaded else None)
