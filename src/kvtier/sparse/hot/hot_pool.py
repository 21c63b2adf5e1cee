"""The hot pool: one layer's frequently used tokens, full-precision K/V in host DRAM.

Every sequence of the batch holds the same number of hot tokens (tokens enter
from the recent window and leave by demotion in equal numbers per sequence;
promotions are swaps), so the pool is a dense [batch, heads, slots, head_dim]
values tensor, the keys in the layout below, plus each slot's token position.
The host scores it with the full-precision keys while the storage scorer works
on the cold pool; the raw q.k it computes per query head are also the chosen
hot tokens' attention logits (selection.py), so the keys are read once per
step. Keys are kept in tiles of TILE tokens, each tile's keys dimension-major
([batch, heads, tiles, head_dim, TILE]): the product, the pool's per-layer hot
spot, then reads each tile as one contiguous 2-4 KiB run, and the compiled
kernel (hot_dots.c) takes it at the memory's read speed, twice torch's product
over a column-major pool on batch-8 shapes, whose head_dim rows a pool apart
were too many streams for the prefetchers.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.kernels import ops

TILE = 16  # tokens per key tile: the kernel's stretch, a 4 KiB run of float32 keys at head_dim 64


class HotPool:
    """Hot tokens of one layer for all sequences; slots 0..used-1 are occupied."""

    def __init__(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, reserve: int = 0,
                 pin: bool = False) -> None:
        self.pin = pin  # page-locked, for fast copies to a CUDA device
        tiles = -(-reserve // TILE)
        self.key_tiles = torch.empty(batch, heads, tiles, head_dim, TILE, dtype=dtype, pin_memory=pin)
        self.values = torch.empty(batch, heads, tiles * TILE, head_dim, dtype=dtype, pin_memory=pin)
        self.positions = np.full((batch, tiles * TILE), -1, dtype=np.int64)
        self.used = 0
        self._capacity = 0  # slots held before `release`

    @property
    def capacity(self) -> int:
        return self.values.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: np.ndarray) -> None:
        """Add n tokens per sequence: K/V [batch, heads, n, head_dim], positions [batch, n]."""
        count = keys.shape[2]
        if self.used + count > self.capacity:
            self.reserve(max(self.used + count, 2 * self.capacity, 64))  # doubling: appends amortize
        slots = torch.arange(self.used, self.used + count)
        self._token_major()[:, :, slots // TILE, slots % TILE] = keys
        self.values[:, :, self.used : self.used + count] = values
        self.positions[:, self.used : self.used + count] = positions
        self.used += count

    def reserve(self, slots: int) -> None:
        """Room for `slots` tokens per sequence (rounded up to whole tiles)."""
        if slots <= self.capacity:
            return
        tiles = -(-slots // TILE)
        extra = tiles * TILE - self.capacity
        self.key_tiles = self._grown(self.key_tiles, tiles, dim=2)
        self.values = self._grown(self.values, tiles * TILE, dim=2)
        self.positions = np.concatenate([self.positions, np.full((len(self.positions), extra), -1)], axis=1)

    def release(self) -> list[torch.Tensor]:
        """Hand over the occupied part of the pool, [keys' tiles, values]: the pool lets go of its memory, which is
        freed when the caller drops them. Positions and `used` stay; `restore` brings the pool back as it was."""
        tiles = -(-self.used // TILE)
        held = [self.key_tiles[:, :, :tiles].contiguous(), self.values[:, :, : self.used].contiguous()]
        self._capacity = self.capacity
        self.key_tiles, self.values = self.key_tiles[:, :, :0].clone(), self.values[:, :, :0].clone()
        return held

    def restore(self, key_tiles: torch.Tensor, values: torch.Tensor) -> None:
        """Take back what `release` handed over, at the capacity the pool had then."""
        tiles = -(-self._capacity // TILE)
        self.key_tiles = self._grown(self.key_tiles, tiles, dim=2)
        self.values = self._grown(self.values, tiles * TILE, dim=2)
        self.key_tiles[:, :, : key_tiles.shape[2]] = key_tiles
        self.values[:, :, : values.shape[2]] = values

    def _token_major(self) -> torch.Tensor:
        """The keys as [batch, heads, tiles, TILE, head_dim], a view: slot s is [..., s // TILE, s % TILE, :]."""
        return self.key_tiles.transpose(3, 4)

    def scores(self, query: torch.Tensor, aggregation: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw q.k [batch, heads, Q, used] (float32) for query [batch, heads, Q, head_dim] (float32), and each token's
        importance [batch, used] from them (`importance`)."""
        if compiled_dots(self.key_tiles.dtype):
            return self._compiled_scores(query, aggregation)
        tiles = self.key_tiles[:, :, : -(-self.used // TILE)]
        tiles = tiles if tiles.dtype == torch.float32 else tiles.float()
        dots = torch.matmul(query[:, :, None], tiles)  # [batch, heads, tiles, Q, TILE]
        dots = dots.transpose(2, 3).flatten(3)[..., : self.used]
        return dots, importance(dots, aggregation)

    def _compiled_scores(self, query: torch.Tensor, aggregation: str) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads = self.key_tiles.shape[:2]
        dots, token_importance = torch.empty(batch, heads, query.shape[2], self.used), torch.empty(batch, self.used)
        keys = self.key_tiles.view(torch.int16) if self.key_tiles.dtype == torch.bfloat16 else self.key_tiles
        ops.hot_dots(keys=keys.numpy(), query=query.contiguous().numpy(), out=dots.numpy(),
                     importance=token_importance.numpy(), aggregation=aggregation)
        return dots, token_importance

    def _grown(self, tensor: torch.Tensor, slots: int, dim: int) -> torch.Tensor:
        shape = list(tensor.shape)
        shape[dim] = slots
        grown = torch.empty(shape, dtype=tensor.dtype, pin_memory=self.pin)
        grown.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
        return grown

    def score(self, query: torch.Tensor, aggregation: str) -> torch.Tensor:
        """Raw inner-product importance [batch, used] for query [batch, heads, Q, head_dim]."""
        return self.scores(query, aggregation)[1]

    def keys_of(self, seq: int, slots: np.ndarray) -> torch.Tensor:
        """Sequence `seq`'s keys at `slots`, [heads, n, head_dim] (a copy)."""
        index = torch.from_numpy(slots)
        return self._token_major()[seq][:, index // TILE, index % TILE]

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [batch, heads, k, head_dim] of slots [batch, k] (copies)."""
        rows = torch.arange(len(slots))[:, None]
        keys = self._token_major()[rows, :, slots // TILE, slots % TILE].transpose(1, 2).contiguous()
        index = slots[:, None, :, None].expand(-1, self.values.shape[1], -1, self.values.shape[3])
        return keys, self.values.gather(2, index)

    def replace(self, seq: int, slots: np.ndarray, keys: torch.Tensor, values: torch.Tensor,
                positions: np.ndarray) -> None:
        """Overwrite sequence `seq`'s `slots` with K/V [heads, n, head_dim] of tokens at `positions`."""
        index = torch.from_numpy(slots)
        self._token_major()[seq][:, index // TILE, index % TILE] = keys
        self.values[seq][:, index] = values
        self.positions[seq, slots] = positions

    def take(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Remove slots [batch, m] (m distinct per sequence); return their K/V and positions, compacting the rest."""
        removed = torch.from_numpy(slots)
        keys, values = self.gather(removed)
        positions = np.take_along_axis(self.positions, slots, axis=1)
        keep = np.ones((len(slots), self.used), dtype=bool)
        np.put_along_axis(keep, slots, False, axis=1)
        kept = torch.from_numpy(np.nonzero(keep)[1].reshape(len(slots), -1))
        remaining = self.used - slots.shape[1]
        kept_keys, kept_values = self.gather(kept)
        front = torch.arange(remaining)
        self._token_major()[:, :, front // TILE, front % TILE] = kept_keys
        self.values[:, :, :remaining] = kept_values
        self.positions[:, :remaining] = np.take_along_axis(self.positions, kept.numpy(), axis=1)
        self.positions[:, remaining : self.used] = -1
        self.used = remaining
        return keys, values, positions


def compiled_dots(dtype: torch.dtype) -> bool:
    """Whether the compiled kernel (hot_dots.c) takes a pool's q.k: for bfloat16 and float32 keys on a CPU with AVX2
    and FMA. Torch's product over the tiles is a batch of small matrix products, the fallback elsewhere."""
    return ops.VECTORIZED and dtype in (torch.bfloat16, torch.float32)


def importance(dots: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Token importance [batch, tokens] from raw dots [batch, heads, Q, tokens]: summed ("sum") or max over heads."""
    flat = dots.flatten(1, 2)
    return flat.sum(dim=1) if aggregation == "sum" else flat.amax(dim=1)
