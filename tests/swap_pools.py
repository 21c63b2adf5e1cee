"""KV pools filled with random blocks, and snapshots of chosen blocks, for the swap backends' tests."""

import torch

from kvtier.engine.kv_pool import KVPool
from kvtier.storage import KVGeometry

# 2 heads x 64 dims x fp32 x 16 tokens = 8 KiB blocks: page multiples, so no bounce copies.
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")


def filled_pool(blocks: int = 6, device: str = "cpu") -> KVPool:
    pool = KVPool(GEOMETRY, blocks, 16, device)
    generator = torch.Generator().manual_seed(0)
    for layer in range(GEOMETRY.num_layers):
        for kind in (0, 1):
            pool.blocks[layer][kind].copy_(torch.randn(pool.blocks[layer][kind].shape, generator=generator))
    return pool


def snapshot(pool: KVPool, blocks: list[int]) -> list[torch.Tensor]:
    return [pool.blocks[layer][kind][block].clone() for layer in range(GEOMETRY.num_layers)
            for kind in (0, 1) for block in blocks]


def clear(pool: KVPool) -> None:
    for layer in range(GEOMETRY.num_layers):
        for kind in (0, 1):
            pool.blocks[layer][kind].zero_()


def swapped_out_then_damaged(swap, blocks: list[int], layer: int, kind: int, which: int, byte: int):
    """Swap `blocks` out and wait; then invert one byte of the file copy of block `blocks[which]`."""
    pending = swap.swap_out(blocks)
    pending.wait()
    with open(swap.file.path, "r+b") as raw:
        raw.seek(swap.file.layout.offset(layer, kind, pending.slots[which]) + byte)
        original = raw.read(1)[0]
        raw.seek(-1, 1)
        raw.write(bytes([original ^ 0xFF]))
    return pending
