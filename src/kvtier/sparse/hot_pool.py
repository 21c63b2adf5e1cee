"""The hot pool: one layer's frequently used tokens, full-precision K/V in host DRAM.

Every sequence of the batch holds the same number of hot tokens (tokens enter
from the recent window and leave by demotion in equal numbers per sequence;
promotions are swaps), so the pool is a dense [batch, heads, slots, head_dim]
tensor pair plus each slot's token position. The host scores it with the
full-precision keys while the storage scorer works on the cold pool; the raw
q.k it computes per query head are also the chosen hot tokens' attention
logits (selection.py), so the keys are read once per step. Keys are stored
column-major ([batch, heads, head_dim, slots]): that product, the pool's
per-layer hot spot, then reads them contiguously (about a third faster on
the development VM than through a transposed view: docs/decisions.md); a
small compiled kernel (hot_dots.c) takes it where torch's is slow.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.sparse import _hot_dots


class HotPool:
    """Hot tokens of one layer for all sequences; slots 0..used-1 are occupied."""

    def __init__(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, reserve: int = 0,
                 pin: bool = False) -> None:
        self.pin = pin  # page-locked, for fast copies to a CUDA device
        self.key_columns = torch.empty(batch, heads, head_dim, reserve, dtype=dtype, pin_memory=pin)
        self.values = torch.empty(batch, heads, reserve, head_dim, dtype=dtype, pin_memory=pin)
        self.positions = np.full((batch, reserve), -1, dtype=np.int64)
        self.used = 0

    @property
    def keys(self) -> torch.Tensor:
        """The keys as [batch, heads, slots, head_dim] (a view: writes through it land in the pool)."""
        return self.key_columns.transpose(2, 3)

    @property
    def capacity(self) -> int:
        return self.values.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: np.ndarray) -> None:
        """Add n tokens per sequence: K/V [batch, heads, n, head_dim], positions [batch, n]."""
        count = keys.shape[2]
        if self.used + count > self.capacity:
            self.reserve(max(self.used + count, 2 * self.capacity, 64))  # doubling: appends amortize
        self.keys[:, :, self.used : self.used + count] = keys
        self.values[:, :, self.used : self.used + count] = values
        self.positions[:, self.used : self.used + count] = positions
        self.used += count

    def reserve(self, slots: int) -> None:
        """Room for `slots` tokens per sequence."""
        if slots <= self.capacity:
            return
        extra = slots - self.capacity
        self.key_columns = self._grown(self.key_columns, slots, dim=3)
        self.values = self._grown(self.values, slots, dim=2)
        self.positions = np.concatenate([self.positions, np.full((len(self.positions), extra), -1)], axis=1)

    def dots(self, query: torch.Tensor) -> torch.Tensor:
        """Raw q.k [batch, heads, Q, used] (float32) for query [batch, heads, Q, head_dim] (float32)."""
        if compiled_dots(self.key_columns.dtype, query.shape[2]):
            return self._compiled_dots(query)
        columns = self.key_columns[..., : self.used]
        return torch.matmul(query, columns if columns.dtype == torch.float32 else columns.float())

    def _compiled_dots(self, query: torch.Tensor) -> torch.Tensor:
        batch, heads, head_dim, capacity = self.key_columns.shape
        dots = torch.empty(batch, heads, query.shape[2], self.used)
        bf16 = self.key_columns.dtype == torch.bfloat16
        keys = self.key_columns.view(torch.int16) if bf16 else self.key_columns
        _hot_dots.dots(keys.numpy(), query.contiguous().numpy(), dots.numpy(), 2 if bf16 else 4, batch * heads,
                       query.shape[2], head_dim, capacity, self.used)
        return dots

    def _grown(self, tensor: torch.Tensor, slots: int, dim: int) -> torch.Tensor:
        shape = list(tensor.shape)
        shape[dim] = slots
        grown = torch.empty(shape, dtype=tensor.dtype, pin_memory=self.pin)
        grown.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
        return grown

    def score(self, query: torch.Tensor, aggregation: str) -> torch.Tensor:
        """Raw inner-product importance [batch, used] for query [batch, heads, Q, head_dim]."""
        return importance(self.dots(query), aggregation)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [batch, heads, k, head_dim] of slots [batch, k]."""
        index = slots[:, None, :, None].expand(-1, self.keys.shape[1], -1, self.keys.shape[3])
        return self.keys.gather(2, index), self.values.gather(2, index)

    def replace(self, seq: int, slots: np.ndarray, keys: torch.Tensor, values: torch.Tensor,
                positions: np.ndarray) -> None:
        """Overwrite sequence `seq`'s `slots` with K/V [heads, n, head_dim] of tokens at `positions`."""
        index = torch.from_numpy(slots)
        self.keys[seq][:, index] = keys
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
        self.keys[:, :, :remaining], self.values[:, :, :remaining] = kept_keys, kept_values
        self.positions[:, :remaining] = np.take_along_axis(self.positions, kept.numpy(), axis=1)
        self.positions[:, remaining : self.used] = -1
        self.used = remaining
        return keys, values, positions


def compiled_dots(dtype: torch.dtype, group: int) -> bool:
    """Whether the compiled kernel (hot_dots.c) takes a pool's q.k: always for bfloat16 keys, and for float32 keys from
    four query heads per KV head, where it read the pool about twice as fast as torch's product; with fewer, torch's
    ran at the memory's speed (docs/decisions.md)."""
    if not _hot_dots.vectorized:
        return False
    return dtype == torch.bfloat16 or (dtype == torch.float32 and group >= 4)


def importance(dots: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Token importance [batch, tokens] from raw dots [batch, heads, Q, tokens]: summed ("sum") or max over heads."""
    flat = dots.flatten(1, 2)
    return flat.sum(dim=1) if aggregation == "sum" else flat.amax(dim=1)
