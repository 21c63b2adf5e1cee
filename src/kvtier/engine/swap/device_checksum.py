"""Checksums of KV blocks computed where the blocks live (GPU or CPU memory), with torch ops.

The flash cache's POSIX path checksums blocks with crc32c on the host. Blocks
that move by GPUDirect Storage never pass through host memory, and copying
them there only to checksum them would undo the point, so the GPU path uses a
Fletcher-style pair over 16-bit words w_i of each block:

    plain    = sum(w_i)
    weighted = sum(w_i * (i mod 65521 + 1))

in int64, which cannot overflow for blocks under 2^31 bytes (each product is
below 2^33). Any change to one word changes both sums; a swap of two different
words or a block shifted within the file changes the weighted sum. Like any
checksum it can miss a contrived multi-word change; it is there to catch torn,
stale, misplaced and bit-flipped blocks.
"""

from __future__ import annotations

import torch

_MODULUS = 65521  # the largest prime below 2^16, Fletcher/Adler's choice


def block_checksums(rows: torch.Tensor) -> torch.Tensor:
    """[n, 2] int64 checksums of the rows of a uint8 [n, nbytes] tensor (nbytes even), on its device."""
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] % 2:
        raise ValueError(f"block_checksums takes a uint8 [blocks, even bytes] tensor, got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    words = rows.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    weights = torch.arange(words.shape[1], device=rows.device, dtype=torch.int64) % _MODULUS + 1
    return torch.stack((words.sum(dim=1), (words * weights).sum(dim=1)), dim=1)
