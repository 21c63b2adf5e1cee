"""HiFC's flash cache: swap KV blocks to a pre-created file on the SSD, written append-only.

One slot of the swap space is one block index of a `KVBlockFile` whose layout
is the HiFC appendix formula (layer l at l*2*B*stride, K then V, 4 KiB-aligned
blocks). Slots come from `FlashLog`, so a swap-out of n blocks gets n
consecutive slots at the log head: per (layer, kind) that is one contiguous
range, written by one pwritev straight from the pool's page-aligned block
memory with O_DIRECT (no staging copy), spread over the I/O engine's threads.
Every block carries a crc32c that is verified on swap-in.

The file is scratch space, never a source of truth: nothing in it survives a
run (the log starts empty each time), so `close` deletes it unless the caller
keeps it (`keep_file`, for the benchmark that times reopening a pre-created
file). One process owns it: opening takes its lock before anything else, and a
second process on the same path gets an error naming the first one's pid
rather than truncating a file in use. A file left by a killed run is not
locked: it is reused when its header matches (start-up costs an open, not an
allocation) and recreated when it does not.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

from kvtier.errors import ConfigError, StorageError
from kvtier.engine.config import ALLOCATORS
from kvtier.engine.kv_pool import KVPool
from kvtier.engine.swap.backend import SwapBackend
from kvtier.storage import IOEngine, KVBlockFile
from kvtier.storage.block_file import BlockRequest
from kvtier.storage.file_lock import FileInUseError
from kvtier.storage.flash_log import DEFAULT_SEGMENT_SLOTS, FlashLog, NaiveReuseAllocator, SlotAllocator

log = logging.getLogger(__name__)


def open_flash_file(path: str | os.PathLike[str], pool: KVPool, num_slots: int, model_id: str,
                    io: IOEngine) -> tuple[KVBlockFile, bool]:
    """The flash cache file at `path` for this pool's geometry and `num_slots` slots; (file, reused)."""
    geometry, block_tokens = pool.geometry, pool.block_tokens
    if os.path.isfile(path):
        try:
            file = KVBlockFile.open(path, geometry, block_tokens, model_id, io=io)
        except FileInUseError:
            raise
        except StorageError as error:  # another model, block size or format: the cache is rebuilt below
            log.info("recreating flash cache %s: %s", path, error)
        else:
            if file.layout.num_blocks == num_slots:
                return file, True
            file.close()
    return KVBlockFile.create(path, geometry, block_tokens, num_slots, model_id, io=io), False


class FlashSwap(SwapBackend):
    """Swap space on a flash cache file; `allocator` "log" (HiFC append-only) or "naive" (lowest free slot).

    `keep_file`: leave the file for the next open at `close` (by default it is deleted: it holds nothing a later run
    could use, and a 1 GiB file left behind is shown by no command).
    """

    name = "flash"

    def __init__(self, pool: KVPool, path: str | os.PathLike[str], num_slots: int, model_id: str,
                 io_threads: int = 16, allocator: str = "log", segment_slots: int = DEFAULT_SEGMENT_SLOTS,
                 keep_file: bool = False) -> None:
        self._check_pool(pool)
        self.keep_file = keep_file
        super().__init__(pool, _allocator(allocator, num_slots, segment_slots))
        self.io = IOEngine(io_threads)
        try:
            self.file, self.reused = open_flash_file(path, pool, num_slots, model_id, self.io)
        except BaseException:
            self.io.close()
            raise
        # One submitter thread: write_blocks fans its runs out to the I/O threads and waits for them.
        self._submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-swap")

    @staticmethod
    def _check_pool(pool: KVPool) -> None:
        if pool.device.type != "cpu":
            raise ConfigError(f"this flash backend reads and writes host memory; the pool is on {pool.device}: "
                              "use GdsFlashSwap (kvikio) there, which the engine picks for a GPU pool")

    @property
    def io_backend(self) -> str:
        """How blocks reach the file, for results: direct I/O or the page cache."""
        return "pwritev/preadv, O_DIRECT" if self.file.direct else "pwritev/preadv, buffered (no O_DIRECT here)"

    def _submit_out(self, blocks: list[int], slots: list[int]) -> Future[None]:
        return self._submitter.submit(self._timed_out, blocks, slots)

    def _copy_out(self, blocks: list[int], slots: list[int]) -> None:
        self.file.write_blocks(self._requests(blocks, slots))

    def _copy_in(self, slots: list[int], blocks: list[int]) -> None:
        self.file.read_blocks(self._requests(blocks, slots))

    def _requests(self, blocks: list[int], slots: list[int]) -> list[BlockRequest]:
        return [(layer, kind, slot, self.pool.block_bytes(layer, kind, block))
                for layer in range(self.pool.geometry.num_layers) for kind in (0, 1)
                for block, slot in zip(blocks, slots)]

    def close(self) -> None:
        self._submitter.shutdown(wait=True)
        if self.keep_file:
            self.file.close()
        else:
            self.file.remove()
        self.io.close()


def _allocator(name: str, num_slots: int, segment_slots: int) -> SlotAllocator:
    if name == "log":
        return FlashLog(num_slots, min(segment_slots, num_slots))
    if name == "naive":
        return NaiveReuseAllocator(num_slots)
    raise ConfigError(f"unknown flash allocator {name!r}; choose one of {', '.join(ALLOCATORS)}")
