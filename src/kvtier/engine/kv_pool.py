"""The paged KV pool on the compute device: per layer, K and V tensors of fixed-size blocks.

Each (layer, K|V) pool is one buffer of `num_blocks` blocks, viewed as a tensor
[num_blocks, block_tokens, kv_heads, head_dim]. Blocks are `layout.block_stride`
bytes apart (the payload rounded up to 4 KiB), so every block starts on a page:
on the CPU the buffer comes from `aligned_buffer`, and a swap-out hands the
block's own memory to pwritev with O_DIRECT, without a staging copy. On CUDA the
pool is device memory: flash swap moves it with kvikio (GPUDirect Storage,
swap/gds.py), DRAM swap with device-to-host copies.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.storage import BlockLayout, KVGeometry, aligned_buffer


class KVPool:
    """K and V block tensors for every attention layer of a model."""

    def __init__(self, geometry: KVGeometry, num_blocks: int, block_tokens: int,
                 device: torch.device | str = "cpu") -> None:
        self.geometry = geometry
        self.layout = BlockLayout(geometry, block_tokens, num_blocks)
        self.device = torch.device(device)
        self.dtype = getattr(torch, geometry.dtype)  # KVGeometry dtype names are torch names
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        # raw[layer][kind]: uint8 bytes of the whole pool; blocks[layer][kind]: the tensor view of it.
        self._raw = [[self._backing() for _ in range(2)] for _ in range(geometry.num_layers)]
        self.blocks = [[self._as_blocks(raw) for raw in pair] for pair in self._raw]

    @property
    def nbytes(self) -> int:
        return self.geometry.num_layers * 2 * self.num_blocks * self.layout.block_stride

    def keys(self, layer: int) -> torch.Tensor:
        return self.blocks[layer][0]

    def values(self, layer: int) -> torch.Tensor:
        return self.blocks[layer][1]

    def block_bytes(self, layer: int, kind: int, block: int) -> np.ndarray | torch.Tensor:
        """The payload bytes of one block, sharing memory with the pool (page-aligned start).

        A numpy uint8 array for a CPU pool (what the storage layer's I/O takes), a uint8
        tensor for a device pool.
        """
        return self._raw[layer][kind][self.layout.payload_span(block)]

    def block_rows(self, layer: int, kind: int) -> torch.Tensor:
        """uint8 [num_blocks, block_stride] view of one (layer, K|V) pool: row b is block b and its padding."""
        return _as_tensor(self._raw[layer][kind]).view(self.num_blocks, self.layout.block_stride)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy block `source` over block `destination`, every layer's K and V, for each pair (copy-on-write)."""
        if not copies:
            return
        sources, destinations = (torch.tensor(side, dtype=torch.long, device=self.device) for side in zip(*copies))
        for layer in range(self.geometry.num_layers):
            for kind in range(2):
                rows = self.block_rows(layer, kind)
                rows[destinations] = rows[sources]

    def _backing(self) -> np.ndarray | torch.Tensor:
        nbytes = self.num_blocks * self.layout.block_stride
        if self.device.type == "cpu":
            return aligned_buffer(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    def _as_blocks(self, raw: np.ndarray | torch.Tensor) -> torch.Tensor:
        typed = _as_tensor(raw).view(self.dtype)
        heads, dim = self.geometry.num_kv_heads, self.geometry.head_dim
        stride = self.layout.block_stride // self.geometry.itemsize
        return typed.as_strided((self.num_blocks, self.block_tokens, heads, dim),
                                (stride, heads * dim, dim, 1))


def _as_tensor(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The pool's bytes as a uint8 tensor sharing their memory."""
    return torch.from_numpy(raw) if isinstance(raw, np.ndarray) else raw
