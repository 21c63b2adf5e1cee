"""GdsFlashSwap's mechanics on the CPU: kvikio's CuFile replaced by a POSIX stand-in with its contract.

The real kvikio path runs in test_gds_gpu.py where a GPU and kvikio exist.
"""

import os
import sys

import numpy as np
import pytest
import torch
from swap_pools import clear, filled_pool, snapshot, swapped_out_then_damaged

from kvtier.errors import ChecksumError, ConfigError, StorageError
from kvtier.engine.serving_engine import flash_backend
from kvtier.engine.swap.flash import FlashSwap
from kvtier.engine.swap.gds import GdsFlashSwap, open_cufile


class _Done:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def get(self) -> int:
        return self.nbytes


class PosixCuFile:
    """kvikio.CuFile's pread/pwrite(buf, size, file_offset) -> future of bytes moved, over os.pread/os.pwrite."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR)
        self.calls: list[tuple[str, int, int]] = []

    def pwrite(self, buf: np.ndarray, size: int, file_offset: int) -> _Done:
        self.calls.append(("pwrite", size, file_offset))
        return _Done(os.pwrite(self.fd, memoryview(buf).cast("B")[:size], file_offset))

    def pread(self, buf: np.ndarray, size: int, file_offset: int) -> _Done:
        self.calls.append(("pread", size, file_offset))
        return _Done(os.preadv(self.fd, [memoryview(buf).cast("B")[:size]], file_offset))

    def close(self) -> None:
        os.close(self.fd)


def posix_swap(path: str, **options) -> GdsFlashSwap:
    """A GdsFlashSwap over PosixCuFile; the stand-in is `swap.cufile`, for tests that inspect or rig it."""
    options = {"num_slots": 8, "segment_slots": 4} | options
    opened = []

    def open_posix(file: str, threads: int):
        opened.append(PosixCuFile(file))
        return opened[0], "posix", True

    swap = GdsFlashSwap(filled_pool(), path, model_id="tiny", io_threads=2, open_file=open_posix, **options)
    swap.cufile = opened[0]
    return swap


def test_round_trip_restores_blocks_and_lands_where_the_posix_path_puts_them(flash_path):
    swap = posix_swap(flash_path)
    try:
        expected = snapshot(swap.pool, [4, 1, 3])
        pending = swap.swap_out([4, 1, 3])
        pending.wait()
        assert pending.slots == [0, 1, 2]
        # One write per (layer, kind) for the three consecutive slots: 4 writes of 3 x 8 KiB.
        writes = [call for call in swap.cufile.calls if call[0] == "pwrite"]
        assert sorted(writes) == sorted(("pwrite", 3 * 8192, swap.file.layout.offset(layer, kind, 0))
                                        for layer in range(2) for kind in (0, 1))
        with open(flash_path, "rb") as raw:  # the bytes sit at the HiFC appendix offsets, as FlashSwap's do
            raw.seek(swap.file.layout.offset(1, 1, 2))
            assert raw.read(8192) == swap.pool.block_bytes(1, 1, 3).tobytes()
        clear(swap.pool)
        swap.swap_in(pending.slots, [0, 2, 5])
        assert all(torch.equal(a, b) for a, b in zip(expected, snapshot(swap.pool, [0, 2, 5])))
        assert swap.stats.out_bytes == swap.stats.in_bytes == 3 * 2 * 2 * 8192
        assert swap.allocator.live == 0
    finally:
        swap.close()


def test_scattered_slots_of_the_naive_allocator_are_moved_run_by_run(flash_path):
    swap = posix_swap(flash_path, allocator="naive")
    try:
        first, second, third = swap.swap_out([0]), swap.swap_out([1]), swap.swap_out([2])
        for pending in (first, second, third):
            pending.wait()
        swap.swap_in(second.slots, [1])  # frees slot 1: the next swap-out of two gets slots 1 and 3
        expected = snapshot(swap.pool, [4, 5])
        fourth = swap.swap_out([4, 5])
        fourth.wait()
        assert fourth.slots == [1, 3]
        clear(swap.pool)
        swap.swap_in(fourth.slots, [4, 5])
        assert all(torch.equal(a, b) for a, b in zip(expected, snapshot(swap.pool, [4, 5])))
    finally:
        swap.close()


def test_a_damaged_block_is_caught_before_it_reaches_the_pool(flash_path):
    swap = posix_swap(flash_path)
    try:
        pending = swapped_out_then_damaged(swap, [0, 1], layer=1, kind=1, which=1, byte=100)
        clear(swap.pool)
        with pytest.raises(ChecksumError, match="layer 1 V slot 1"):
            swap.swap_in(pending.slots, [2, 3])
        assert all(not tensor.any() for tensor in snapshot(swap.pool, [2, 3]))  # nothing was scattered
        assert swap.allocator.live == 0
    finally:
        swap.close()


def test_a_truncated_file_is_a_storage_error_not_a_short_read(flash_path):
    swap = posix_swap(flash_path)
    try:
        pending = swap.swap_out([0])
        pending.wait()
        os.truncate(flash_path, swap.file.layout.offset(0, 1, 0))  # layer 0's K survives, the rest is gone
        with pytest.raises(StorageError, match="truncated"):
            swap.swap_in(pending.slots, [1])
    finally:
        swap.close()


def test_a_failed_open_leaves_no_file_handles(flash_path):
    def refuse(path, threads):
        raise ConfigError("no kvikio here")

    pool = filled_pool()
    fds_before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(ConfigError, match="no kvikio"):
        GdsFlashSwap(pool, flash_path, 4, "tiny", open_file=refuse)
    assert set(os.listdir("/proc/self/fd")) <= fds_before  # the block file was closed again


def test_without_kvikio_the_error_says_what_to_install(flash_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvikio", None)  # import kvikio fails as where it is not installed
    with pytest.raises(ConfigError, match="pip install kvikio-cu12"):
        open_cufile(flash_path, 4)


def test_the_engine_moves_gpu_pools_with_kvikio_and_host_pools_with_o_direct():
    assert flash_backend(torch.device("cuda", 0)) is GdsFlashSwap
    assert flash_backend(torch.device("cpu")) is FlashSwap


def test_a_request_refused_at_submission_is_a_storage_error_after_the_others_finish(flash_path):
    swap = posix_swap(flash_path)
    try:
        pending = swap.swap_out([0, 1])
        pending.wait()
        submitted = []

        def refuse_the_third(buffer, size, file_offset):
            if len(submitted) == 2:
                raise RuntimeError("cuFile: bad address")
            submitted.append(file_offset)
            return _Done(size)

        swap.cufile.pread = refuse_the_third
        with pytest.raises(StorageError, match="pread failed: cuFile: bad address"):
            swap.swap_in(pending.slots, [2, 3])
        assert len(submitted) == 2 and swap.allocator.live == 0
    finally:
        swap.close()
