"""The skeleton of every selective-attention layer (HillInfer's `--kv sparse` and the baselines).

A full-attention layer is prefilled densely (the model's own attention). At the
first decode step it is *distributed*: the sink (first tokens) and the recent
window stay on the compute device and every other token goes to a pool that
the subclass owns (its tiers, its bookkeeping). Each decode step appends the new
token to the window and attends the window plus what the subclass selects from
its pool; after attention the subclass calls `retire()`, which drops the tokens
that fell out of the recent window from it, `retire_batch` at a time, and
returns them for the subclass to pool.

A subclass says how many recent tokens stay at distribution (`kept_recent`)
and fills in the pool: `make_pool`, `place` (the prompt's middle at
distribution), `pool_tokens`, and its decode `attend` (which pools what
`retire()` returns).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import NamedTuple

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from kvtier.errors import ConfigError


class Retired(NamedTuple):
    """Tokens leaving the recent window: K/V [B, H, n, D] on the device, their positions [n] (int64)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: np.ndarray


class WindowedLayer(CacheLayerMixin):
    """Device window (sink + recent tokens) of one full-attention layer, and the pool its subclass keeps."""

    is_sliding = False

    def __init__(self, layer_idx: int, max_tokens: int, sink: int, kept_recent: int, retire_batch: int = 1) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.max_tokens = max_tokens
        self.sink = sink
        self.kept_recent = kept_recent  # recent tokens left on the device when tokens leave the window
        self.retire_batch = retire_batch
        self.tokens = 0
        self.distributed = False
        self.sink_tokens = 0
        self.window_positions = np.empty(0, dtype=np.int64)  # token position of each device column

    # ----- what a subclass defines -----

    @abstractmethod
    def make_pool(self, batch: int, heads: int, head_dim: int) -> None:
        """Create the pool (first update)."""

    @abstractmethod
    def place(self, pool: slice) -> None:
        """Move the prompt's tokens at window columns `pool` (positions alike) into the pool (distribution)."""

    @abstractmethod
    def pool_tokens(self) -> tuple[int, int]:
        """Pooled tokens per sequence (host, storage)."""

    def observe(self, query: torch.Tensor, scaling: float) -> None:
        """A prefill chunk's queries [B, Hq, q, D] (after update stored its keys)."""

    # ----- cache protocol -----

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        batch, heads, _, head_dim = key_states.shape
        self.make_pool(batch, heads, head_dim)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        count = key_states.shape[2]
        if self.distributed or (count == 1 and self.tokens > 0):
            if count > 1:
                raise ConfigError("a selective KV cache (kv='sparse' and the baselines) decodes one token per "
                                  "forward pass after the prompt; feed the whole prompt before decoding")
            self.distribute()
            self.window_positions = np.append(self.window_positions, self.tokens)
        self.keys = torch.cat([self.keys, key_states], dim=2)
        self.values = torch.cat([self.values, value_states], dim=2)
        self.tokens += count
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tokens + query_length, 0

    def get_max_length(self) -> int:
        return self.max_tokens

    def tier_tokens(self) -> dict[str, int]:
        """Tokens per sequence in each tier."""
        if not self.distributed:
            return {"device": self.tokens, "host": 0, "storage": 0}
        host, storage = self.pool_tokens()
        return {"device": self.keys.shape[2], "host": host, "storage": storage}

    # ----- the window -----

    def distribute(self) -> None:
        """Split the prompt: sink and the last `kept_recent` tokens stay, the rest is placed (once)."""
        if self.distributed:
            return
        tokens = self.tokens
        sink = min(self.sink, tokens)
        recent_start = max(sink, tokens - self.kept_recent)
        self.sink_tokens = sink
        self.window_positions = np.arange(tokens, dtype=np.int64)
        self.place(slice(sink, recent_start))
        self._keep(torch.cat([torch.arange(sink), torch.arange(recent_start, tokens)]))
        self.distributed = True

    def retire(self) -> Retired | None:
        """Drop the tokens past the recent window (beyond `kept_recent`) from it, at least `retire_batch` at once, and
        return them for the subclass's pool; None while fewer are past it."""
        excess = self.keys.shape[2] - self.sink_tokens - self.kept_recent
        if excess < self.retire_batch:
            return None
        moving = slice(self.sink_tokens, self.sink_tokens + excess)
        retired = Retired(self.keys[:, :, moving], self.values[:, :, moving], self.window_positions[moving])
        self._keep(torch.cat([torch.arange(self.sink_tokens), torch.arange(moving.stop, self.keys.shape[2])]))
        return retired

    def _keep(self, columns: torch.Tensor) -> None:
        """Only these device columns stay in the window."""
        self.keys, self.values = self.keys[:, :, columns], self.values[:, :, columns]
        self.window_positions = self.window_positions[columns.numpy()]
