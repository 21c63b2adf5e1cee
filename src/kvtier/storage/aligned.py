"""Page-aligned host buffers, and flat byte views of the buffers callers hand us.

O_DIRECT I/O needs the buffer address, the length and the file offset to be
multiples of the device's logical block size; we use 4 KiB (PAGE) everywhere.
Anonymous mmap memory is page-aligned by construction, zero-filled, and given
back to the OS as soon as the array that holds it is garbage-collected.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from kvtier.storage.geometry import PAGE, round_up


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A zero-filled uint8 array of `nbytes` whose first byte is PAGE-aligned."""
    if nbytes < 0:
        raise ValueError(f"buffer size must not be negative, got {nbytes}")
    # mmap rejects length 0, so even an empty buffer maps one page.
    mapping = mmap.mmap(-1, round_up(max(nbytes, 1), PAGE))
    return np.frombuffer(mapping, dtype=np.uint8, count=nbytes)


def byte_view(buf: Any) -> np.ndarray:
    """A flat uint8 view (no copy) of a C-contiguous buffer: bytes-like, numpy array or CPU tensor.

    Tensors without a numpy dtype (bfloat16) must be viewed as uint8 first: `tensor.view(torch.uint8)`.
    """
    try:
        if isinstance(buf, np.ndarray):
            array = buf
        elif _has_buffer_protocol(buf):
            array = np.asarray(memoryview(buf))
        else:  # CPU tensors share their memory with numpy through __array__
            array = np.asarray(buf)
    except TypeError as error:
        raise TypeError(f"cannot view {type(buf).__name__} as bytes ({error}); "
                        "pass a contiguous bytes-like object, numpy array or uint8 CPU tensor") from error
    if not array.flags.c_contiguous:
        raise ValueError(f"buffer of type {type(buf).__name__} is not contiguous; pass a contiguous copy")
    return array.reshape(-1).view(np.uint8)


def _has_buffer_protocol(buf: Any) -> bool:
    try:
        memoryview(buf)
    except TypeError:
        return False
    return True


def address_of(buf: Any) -> int:
    """Address of the first byte of `buf`."""
    return byte_view(buf).ctypes.data


def is_aligned(buf: Any, unit: int = PAGE) -> bool:
    """True when the address and the length of `buf` are both multiples of `unit` (O_DIRECT-safe for reads of
    that unit)."""
    view = byte_view(buf)
    return view.ctypes.data % unit == 0 and view.nbytes % unit == 0
