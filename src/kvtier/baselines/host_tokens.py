"""The host part of a baseline's pool: its newest tokens in DRAM, in position order.

A queue: tokens join at the end as they leave the device window, and the
oldest leave from the front, whole blocks at a time, for the disk
(selective.py). Kept token-major ([batch, heads, tokens, head_dim]), the
layout the baselines read whole or by index every step; --kv sparse's hot
pool, scored by a kernel, keeps its keys in tiles instead (sparse/hot/hot_pool.py).
"""

from __future__ import annotations

import torch


class HostTokens:
    """K/V [batch, heads, used, head_dim] of the newest pooled tokens (views of growable buffers)."""

    def __init__(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self._keys = torch.empty(batch, heads, 0, head_dim, dtype=dtype)
        self._values = torch.empty_like(self._keys)
        self.used = 0

    @property
    def keys(self) -> torch.Tensor:
        return self._keys[:, :, : self.used]

    @property
    def values(self) -> torch.Tensor:
        return self._values[:, :, : self.used]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add K/V [batch, heads, n, head_dim] at the end."""
        count = keys.shape[2]
        if self.used + count > self._keys.shape[2]:
            room = max(self.used + count, 2 * self._keys.shape[2], 64)  # doubling: appends amortize
            self._keys, self._values = (_grown(buffer, room) for buffer in (self._keys, self._values))
        self._keys[:, :, self.used : self.used + count] = keys
        self._values[:, :, self.used : self.used + count] = values
        self.used += count

    def pop_front(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove the oldest `count` tokens; return their K/V (copies)."""
        keys, values = self.keys[:, :, :count].clone(), self.values[:, :, :count].clone()
        rest = self.used - count
        self._keys[:, :, :rest] = self._keys[:, :, count : self.used].clone()
        self._values[:, :, :rest] = self._values[:, :, count : self.used].clone()
        self.used = rest
        return keys, values


def _grown(buffer: torch.Tensor, tokens: int) -> torch.Tensor:
    grown = buffer.new_empty(*buffer.shape[:2], tokens, buffer.shape[3])
    grown[:, :, : buffer.shape[2]] = buffer
    return grown
