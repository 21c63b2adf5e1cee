"""The swap-space interface shared by the flash cache and the host-DRAM baseline.

A swap-out moves all blocks of one victim sequence from the device pool into
`num_slots` swap slots; it is asynchronous (vLLM kv_offload's two phases): the
call reserves slots and submits the copy, and the returned `PendingSwapOut`
completes when the data is safe. Until then the device blocks stay pinned (the
scheduler frees them only after `wait()`). A swap-in is synchronous: the
sequence cannot step before its KV is back. Both backends raise
`FlashFullError` (from the slot allocator) when the swap space cannot take a
sequence; the scheduler then falls back to recompute.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvtier.engine.kv_pool import KVPool
from kvtier.storage.flash_log import SlotAllocator


@dataclass
class SwapStats:
    """Blocks and bytes moved, and seconds spent moving them (measured around the copies themselves)."""

    out_blocks: int = 0
    in_blocks: int = 0
    out_bytes: int = 0
    in_bytes: int = 0
    out_seconds: float = 0.0
    in_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, direction: str, blocks: int, nbytes: int, seconds: float) -> None:
        with self._lock:  # swap-outs finish on I/O threads
            setattr(self, f"{direction}_blocks", getattr(self, f"{direction}_blocks") + blocks)
            setattr(self, f"{direction}_bytes", getattr(self, f"{direction}_bytes") + nbytes)
            setattr(self, f"{direction}_seconds", getattr(self, f"{direction}_seconds") + seconds)

    def bandwidth(self, direction: str) -> float:
        """Bytes per second while copying (0 before any copy)."""
        seconds = getattr(self, f"{direction}_seconds")
        return getattr(self, f"{direction}_bytes") / seconds if seconds else 0.0

    def to_dict(self) -> dict[str, float]:
        names = ("out_blocks", "in_blocks", "out_bytes", "in_bytes", "out_seconds", "in_seconds")
        return {name: getattr(self, name) for name in names} | {
            "out_bandwidth": self.bandwidth("out"), "in_bandwidth": self.bandwidth("in")}


@dataclass(frozen=True)
class PendingSwapOut:
    """Slots reserved for a swap-out and the copy in flight; `wait()` raises the copy's error."""

    slots: list[int]
    future: Future[None]

    def wait(self) -> None:
        self.future.result()


class SwapBackend(ABC):
    """Swap slots for whole device blocks (all layers' K and V of `block_tokens` tokens each)."""

    name: str

    def __init__(self, pool: KVPool, allocator: SlotAllocator) -> None:
        self.pool = pool
        self.allocator = allocator
        self.stats = SwapStats()

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    @property
    @abstractmethod
    def io_backend(self) -> str:
        """How the bytes move (e.g. O_DIRECT, kvikio's mode, device-to-host copies), for results."""

    @property
    def block_bytes(self) -> int:
        """Bytes one device block holds over all layers and both kinds (what one slot stores)."""
        return self.pool.geometry.num_layers * 2 * self.pool.layout.block_bytes

    def swap_out(self, blocks: list[int]) -> PendingSwapOut:
        """Reserve a slot per device block and start copying them out (in order).

        Raises:
            FlashFullError: not enough slots now; nothing was reserved or copied.
        """
        slots = self.allocator.allocate(len(blocks))
        return PendingSwapOut(slots, self._submit_out(blocks, slots))

    def swap_in(self, slots: list[int], blocks: list[int]) -> None:
        """Copy the slots back into device blocks, then release the slots (also when the copy fails)."""
        started = time.perf_counter()
        try:
            self._copy_in(slots, blocks)
        finally:
            self.allocator.free(slots)
        self.stats.add("in", len(blocks), len(blocks) * self.block_bytes, time.perf_counter() - started)

    def discard(self, slots: list[int]) -> None:
        """Release slots whose contents are no longer needed (e.g. their swap-out failed)."""
        self.allocator.free(slots)

    def _timed_out(self, blocks: list[int], slots: list[int]) -> None:
        """Run the copy-out and account for it; called on a worker thread."""
        started = time.perf_counter()
        self._copy_out(blocks, slots)
        self.stats.add("out", len(blocks), len(blocks) * self.block_bytes, time.perf_counter() - started)

    @abstractmethod
    def _submit_out(self, blocks: list[int], slots: list[int]) -> Future[None]:
        """Start `_timed_out(blocks, slots)` in the background."""

    @abstractmethod
    def _copy_out(self, blocks: list[int], slots: list[int]) -> None:
        """Copy device blocks into slots (blocking)."""

    @abstractmethod
    def _copy_in(self, slots: list[int], blocks: list[int]) -> None:
        """Copy slots into device blocks (blocking); verify what can be verified."""

    @abstractmethod
    def close(self) -> None:
        """Wait for copies in flight and release files, threads and memory."""
