"""The baseline: vLLM-style swap space in host DRAM, with the same slots and interface as the flash cache.

Host tensors [num_slots, block_tokens, kv_heads, head_dim] per layer and kind,
committed at start-up (zero-filled, as vLLM's pinned allocation touches every
page), handed out by vLLM's free-list policy (`NaiveReuseAllocator`: reuse the
lowest free slot). Copies run on a thread pool, one task per layer, so the
swap-out overlaps the running batch exactly like the flash backend's. DRAM is
trusted (ECC), so nothing is checksummed.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvtier.serve.kv_pool import KVPool
from kvtier.serve.swap import SwapBackend
from kvtier.storage.flash_log import NaiveReuseAllocator
from kvtier.storage.io_engine import gather


class DramSwap(SwapBackend):
    """Swap space of `num_slots` blocks in host memory."""

    name = "dram"

    def __init__(self, pool: KVPool, num_slots: int, threads: int = 16) -> None:
        super().__init__(pool, NaiveReuseAllocator(num_slots))
        shape = (num_slots, pool.block_tokens, pool.geometry.num_kv_heads, pool.geometry.head_dim)
        pin = pool.device.type == "cuda"
        self.host = [[torch.zeros(shape, dtype=pool.dtype, pin_memory=pin) for _ in range(2)]
                     for _ in range(pool.geometry.num_layers)]
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtier-dram")
        self._submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-swap")

    def _submit_out(self, blocks: list[int], slots: list[int]) -> Future[None]:
        return self._submitter.submit(self._timed_out, blocks, slots)

    def _copy_out(self, blocks: list[int], slots: list[int]) -> None:
        self._per_layer(blocks, slots, to_host=True)

    def _copy_in(self, slots: list[int], blocks: list[int]) -> None:
        self._per_layer(blocks, slots, to_host=False)

    def _per_layer(self, blocks: list[int], slots: list[int], to_host: bool) -> None:
        device_index = torch.tensor(blocks, dtype=torch.long, device=self.pool.device)
        host_index = torch.tensor(slots, dtype=torch.long)
        futures = [self._threads.submit(self._copy_layer, layer, device_index, host_index, to_host)
                   for layer in range(self.pool.geometry.num_layers)]
        gather(futures).result()

    def _copy_layer(self, layer: int, device_index: torch.Tensor, host_index: torch.Tensor, to_host: bool) -> None:
        for kind in (0, 1):
            pool, host = self.pool.blocks[layer][kind], self.host[layer][kind]
            if to_host:
                host[host_index] = pool[device_index].to("cpu", non_blocking=False)
            else:
                pool[device_index] = host[host_index].to(pool.device)

    def close(self) -> None:
        self._submitter.shutdown(wait=True)
        self._threads.shutdown(wait=True)
