"""The serving engine's configuration: pool, swap and batching limits, validated without torch.

The command line checks `kvtier serve` / `kvtier batch` options against it before it imports torch
(seconds on a small machine), so a bad option is refused at once; serving_engine.py builds the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.storage.flash_log import DEFAULT_SEGMENT_SLOTS
from kvtier.units import parse_size

SWAP_MODES = ("flash", "dram", "recompute")
ALLOCATORS = ("log", "naive")  # the flash file's slot policies (swap/flash.py)


@dataclass(frozen=True)
class EngineConfig:
    """Pool and swap sizes. Sizes accept units (`256MiB`); `device_blocks` overrides `device_kv_budget`."""

    block_tokens: int = 64  # HiFC's best block size (the HiFC paper, Fig. 6)
    device_kv_budget: int | str = "256MiB"
    device_blocks: int | None = None
    swap: str = "flash"
    swap_space: int | str = "1GiB"  # flash file / host pool size (same slot count for both)
    flash_path: str | None = None  # default: <user cache>/kvtier/kv/flash-<model>-<block>.kvc
    flash_allocator: str = "log"  # "log" (HiFC append-only) or "naive" (reuse lowest free slot)
    segment_slots: int = DEFAULT_SEGMENT_SLOTS
    io_threads: int = 16
    max_num_seqs: int = 32
    max_batched_tokens: int = 512
    # Tiered sequences (tiered.py), for an engine given a TierProvider: the host DRAM their hot pools share, in
    # `max_tiered_seqs` equal shares (one per running tiered sequence).
    host_kv_budget: int | str = "256MiB"
    max_tiered_seqs: int = 4
    # Decode tokens after which a tiered sequence yields its share to a waiting tiered request (its window and hot
    # pool set aside on flash, scheduler.py); 0: it keeps its share to its end.
    tiered_slice: int = 0

    def validated(self) -> EngineConfig:
        if self.swap not in SWAP_MODES:
            raise ConfigError(f"unknown swap mode {self.swap!r}; choose one of {', '.join(SWAP_MODES)}")
        if not 16 <= self.block_tokens <= 256:
            raise ConfigError(f"block_tokens must be between 16 and 256, got {self.block_tokens}")
        if self.io_threads < 1:
            raise ConfigError(f"io_threads must be at least 1, got {self.io_threads}")
        if self.max_tiered_seqs < 1:
            raise ConfigError(f"max_tiered_seqs must be at least 1, got {self.max_tiered_seqs}")
        if self.tiered_slice < 0:
            raise ConfigError(f"tiered_slice must be 0 (off) or a positive token count, got {self.tiered_slice}")
        parse_size(self.device_kv_budget), parse_size(self.swap_space), parse_size(self.host_kv_budget)
        return self
