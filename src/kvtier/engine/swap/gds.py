"""HiFC's flash cache for a KV pool in GPU memory: blocks move between GPU memory and the
file through kvikio (NVIDIA GPUDirect Storage), never through buffers of ours on the host.

The file, its slots and the append-only log are FlashSwap's (flash.py): same
header, same HiFC appendix offsets, so a slot's bytes sit where the POSIX path
would put them. What differs is how bytes move:

- swap-out: per (layer, K|V), the victim's blocks are gathered into one device
  staging tensor (a device-to-device copy; a sequence's blocks are scattered in
  the pool) and written with one `CuFile.pwrite` per run of consecutive slots,
  so each request is n blocks long; kvikio splits it into task-size pieces over
  its thread pool (`io_threads`), and cuFile DMAs them when GDS is available.
- swap-in: each run is read into staging with `CuFile.pread`, every block's
  checksum is verified there, and only then are the blocks scattered into the
  pool: a damaged block never reaches the KV the model attends to.

Checksums: crc32c would need the bytes on the host, so blocks get the device
checksum of device_checksum.py, kept in GPU memory for the run (the file is a
cache: nothing in it is read by a later run).

kvikio chooses at start-up between cuFile (GDS) and its compatibility mode
(POSIX reads and writes through its own pinned bounce buffers), e.g. where the
GDS driver or /run/udev is missing; `io_backend` says which one ran, and
`kvtier bench serve` records it. Direct I/O is switched on for compatibility
mode where kvikio allows it; otherwise the file's pages are dropped before each
swap-in, so swap-ins are measured against the disk, not the page cache.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtier.errors import ChecksumError, ConfigError, StorageError
from kvtier.engine.swap.device_checksum import block_checksums
from kvtier.engine.swap.flash import FlashSwap
from kvtier.engine.kv_pool import KVPool
from kvtier.storage.flash_log import DEFAULT_SEGMENT_SLOTS
from kvtier.storage.geometry import KIND_NAMES
from kvtier.storage.io_engine import consecutive_spans

# (path, I/O threads) -> (file with kvikio.CuFile's pread/pwrite/close, description, reads bypass the page cache)
CuFileOpener = Callable[[str, int], tuple[Any, str, bool]]


def open_cufile(path: str, threads: int) -> tuple[Any, str, bool]:
    """`path` opened through kvikio with `threads` I/O threads; (CuFile, what kvikio runs on, direct reads)."""
    try:
        import kvikio
        import kvikio.defaults
    except ImportError as error:
        raise ConfigError("flash swap of a GPU KV pool needs kvikio (GPUDirect Storage): "
                          "pip install kvikio-cu12 or kvikio-cu13 (matching your CUDA), or use --swap dram") from error
    kvikio.defaults.set("num_threads", threads)
    gds = not kvikio.defaults.is_compat_mode_preferred()  # AUTO resolves to cuFile where it works
    direct = _ask_for_direct_io(kvikio) or gds  # asked either way: kvikio may still fall back to POSIX
    mode = "GPUDirect Storage (cuFile)" if gds else "compatibility mode (POSIX through pinned bounce buffers)"
    description = f"kvikio {kvikio.__version__}, {mode}" + (", O_DIRECT" if direct else "")
    return kvikio.CuFile(path, "r+"), description, direct


def _ask_for_direct_io(kvikio: Any) -> bool:
    """Make kvikio's POSIX path use O_DIRECT where this kvikio has the switch; whether it did."""
    try:
        kvikio.defaults.set({"auto_direct_io_read": True, "auto_direct_io_write": True})
    except (KeyError, ValueError, TypeError, AttributeError):  # an older kvikio without the settings
        return False
    return True


class GdsFlashSwap(FlashSwap):
    """FlashSwap for a pool in GPU memory, moved by kvikio (a CPU pool works too: kvikio takes host memory)."""

    def __init__(self, pool: KVPool, path: str | os.PathLike[str], num_slots: int, model_id: str,
                 io_threads: int = 16, allocator: str = "log", segment_slots: int = DEFAULT_SEGMENT_SLOTS,
                 keep_file: bool = False, open_file: CuFileOpener = open_cufile) -> None:
        super().__init__(pool, path, num_slots, model_id, io_threads, allocator, segment_slots, keep_file)
        try:
            self._cufile, self._description, self._direct_reads = open_file(self.file.path, io_threads)
        except BaseException:
            super().close()
            raise
        layers = pool.geometry.num_layers
        # [layer, kind, slot] -> the block's (plain, weighted) checksum, set once its write is done.
        self._checksums = torch.zeros((layers, 2, self.num_slots, 2), dtype=torch.int64, device=pool.device)

    @staticmethod
    def _check_pool(pool: KVPool) -> None:
        """kvikio reads and writes device and host memory alike."""

    @property
    def io_backend(self) -> str:
        return self._description

    def _copy_out(self, blocks: list[int], slots: list[int]) -> None:
        index = torch.tensor(blocks, device=self.pool.device)
        staged = {part: self.pool.block_rows(*part).index_select(0, index) for part in self._parts()}
        checksums = {part: block_checksums(rows[:, :self.pool.layout.block_bytes]) for part, rows in staged.items()}
        _wait_for_device(self.pool.device)  # kvikio reads device memory outside torch's stream order
        self._transfer("pwrite", staged, slots)
        for (layer, kind), sums in checksums.items():  # only now: a block must not look valid before it is on disk
            self._checksums[layer, kind, slots] = sums

    def _copy_in(self, slots: list[int], blocks: list[int]) -> None:
        shape = (len(slots), self.pool.layout.block_stride)
        staged = {part: torch.empty(shape, dtype=torch.uint8, device=self.pool.device) for part in self._parts()}
        _wait_for_device(self.pool.device)  # staging may reuse memory that queued kernels still use
        if not self._direct_reads:
            self.file.drop_page_cache()
        self._transfer("pread", staged, slots)
        self._verify(staged, slots)
        index = torch.tensor(blocks, device=self.pool.device)
        for (layer, kind), rows in staged.items():
            self.pool.block_rows(layer, kind).index_copy_(0, index, rows)

    def _parts(self) -> list[tuple[int, int]]:
        return [(layer, kind) for layer in range(self.pool.geometry.num_layers) for kind in (0, 1)]

    def _transfer(self, verb: str, staged: dict[tuple[int, int], torch.Tensor], slots: list[int]) -> None:
        """One kvikio request per (layer, kind) and run of consecutive slots; wait for all of them."""
        requests = []
        try:
            for (layer, kind), rows in staged.items():
                for span in consecutive_spans(slots):
                    run = rows[span]
                    offset = self.file.layout.offset(layer, kind, slots[span.start])
                    buffer = run.numpy() if run.device.type == "cpu" else run  # kvikio takes host memory as arrays
                    requests.append((getattr(self._cufile, verb)(buffer, run.nbytes, offset), run.nbytes, offset))
        except (RuntimeError, OSError) as error:  # refused at submission: let the requests in flight finish first
            _wait_all(requests, verb, self.file.path)
            raise StorageError(f"{self.file.path}: {verb} failed: {error}") from error
        _wait_all(requests, verb, self.file.path)

    def _verify(self, staged: dict[tuple[int, int], torch.Tensor], slots: list[int]) -> None:
        """Compare every staged block's checksum with the one recorded at swap-out (one device sync in all)."""
        block_bytes = self.pool.layout.block_bytes
        found = torch.stack([block_checksums(rows[:, :block_bytes]) for rows in staged.values()])
        stored = self._checksums[:, :, slots].reshape(found.shape)  # (layer, kind) in `_parts` order, as staged
        bad = (found != stored).any(dim=2).nonzero()
        if bad.numel():
            part, row = (int(value) for value in bad[0])
            layer, kind = list(staged)[part]
            raise ChecksumError(f"{self.file.path}: checksum mismatch in layer {layer} {KIND_NAMES[kind]} "
                                f"slot {slots[row]}; the flash cache file is damaged")

    def close(self) -> None:
        self._submitter.shutdown(wait=True)  # no write may still be using the file
        self._cufile.close()
        super().close()


def _wait_for_device(device: torch.device) -> None:
    """Block until the kernels this thread has queued so far are done (a no-op on the CPU)."""
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
        event.synchronize()


def _wait_all(requests: Sequence[tuple[Any, int, int]], verb: str, path: str) -> None:
    """Wait for every kvikio future (none may still use its buffer), then report the first failure."""
    errors = []
    for future, nbytes, offset in requests:
        try:
            moved = future.get()
        except (RuntimeError, OSError) as error:  # kvikio raises RuntimeError for failed I/O
            errors.append(StorageError(f"{path}: {verb} of {nbytes} bytes at offset {offset} failed: {error}"))
            continue
        if moved != nbytes:
            errors.append(StorageError(f"{path}: {verb} moved {moved} of {nbytes} bytes at offset {offset}; "
                                       "the flash cache file is truncated: delete it"))
    if errors:
        raise errors[0]
