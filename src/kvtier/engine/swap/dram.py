"""The baseline: vLLM-style swap space in host DRAM, with the same slots and interface as the flash cache.

Per layer and kind, one host buffer of `num_slots` block strides, committed at
start-up (every page written, as vLLM's pinned allocation touches every page),
handed out by vLLM's free-list policy (`NaiveReuseAllocator`: reuse the lowest
free slot). A swap moves each block's bytes between the pool and its slot, one
task per layer on a thread pool, so the swap-out overlaps the running batch
exactly like the flash backend's. DRAM is trusted (ECC): nothing is checksummed.

Bytes move as the flash path moves them: a plain memcpy of each block's bytes
(numpy, which releases the GIL) for a CPU pool, a device-to-host copy for a GPU
pool (vLLM's cudaMemcpyAsync). The first version indexed the block tensors with
torch on the swap threads; every such op started its own OpenMP team, which
fought the model's threads for the two cores: `kvtier bench serve` measured the
DRAM runs at 27 s against 17 s for flash, with 0.1 s spent inside the copies
(equal, 30 s each, with OMP_NUM_THREADS=1). That made the baseline slow for a
reason that has nothing to do with DRAM, so the copies no longer use torch ops
on a CPU pool.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvtier.engine.kv_pool import KVPool
from kvtier.engine.swap.backend import SwapBackend
from kvtier.storage import aligned_buffer
from kvtier.storage.flash_log import NaiveReuseAllocator
from kvtier.storage.io_engine import gather


class DramSwap(SwapBackend):
    """Swap space of `num_slots` blocks in host memory."""

    name = "dram"

    def __init__(self, pool: KVPool, num_slots: int, threads: int = 16) -> None:
        super().__init__(pool, NaiveReuseAllocator(num_slots))
        self.host = [[self._committed(num_slots * pool.layout.block_stride) for _ in range(2)]
                     for _ in range(pool.geometry.num_layers)]
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtier-dram")
        self._submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-swap")

    def _committed(self, nbytes: int) -> np.ndarray | torch.Tensor:
        if self.pool.device.type == "cuda":
            return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        memory = aligned_buffer(nbytes)
        memory[:] = 0  # an anonymous mapping is lazy: write every page now, not during the first swap-out
        return memory

    @property
    def io_backend(self) -> str:
        if self.pool.device.type == "cuda":
            return "device-to-host copies into pinned host memory"
        return "memcpy into committed host memory"

    def _submit_out(self, blocks: list[int], slots: list[int]) -> Future[None]:
        return self._submitter.submit(self._timed_out, blocks, slots)

    def _copy_out(self, blocks: list[int], slots: list[int]) -> None:
        self._per_layer(blocks, slots, to_host=True)

    def _copy_in(self, slots: list[int], blocks: list[int]) -> None:
        self._per_layer(blocks, slots, to_host=False)

    def _per_layer(self, blocks: list[int], slots: list[int], to_host: bool) -> None:
        futures = [self._threads.submit(self._copy_layer, layer, blocks, slots, to_host)
                   for layer in range(self.pool.geometry.num_layers)]
        gather(futures).result()

    def _copy_layer(self, layer: int, blocks: list[int], slots: list[int], to_host: bool) -> None:
        for kind in (0, 1):
            host = self.host[layer][kind]
            for block, slot in zip(blocks, slots):
                device_bytes = self.pool.block_bytes(layer, kind, block)
                slot_bytes = host[self.pool.layout.payload_span(slot)]
                if to_host:
                    slot_bytes[:] = device_bytes
                else:
                    device_bytes[:] = slot_bytes

    def close(self) -> None:
        self._submitter.shutdown(wait=True)
        self._threads.shutdown(wait=True)
