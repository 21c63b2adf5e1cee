"""FlexGen-style full offload: a transformers Cache whose KV spills device -> host -> disk.

Each tiered layer keeps its tokens in order as [storage | host | device]: the
oldest whole blocks live in a KVBlockFile on disk, the next blocks in host
DRAM, the newest tokens on the compute device. Every decode step rebuilds the
layer's full K/V by reading *all* its stored blocks from disk (O_DIRECT), so
attention is exact and greedy output equals a dense cache token for token.

Layer prefetch: right after layer l has assembled its K/V (the disk bytes are
copied out of the staging buffer), the read of the next tiered layer's blocks
is submitted to the I/O thread pool, so it overlaps layer l's attention and
MLP. One staging buffer is enough because of that ordering.

A stored prefix (a document KV store entry whose K/V a replay fed to the cache)
is used where it lies: a layer's disk part is [the base's first tokens | its own
blocks]. While nothing of a layer has been written to its own file, whole blocks
spilled from within the prefix are only counted into the base, not written
again; reading the layer reads those tokens from the entry (every record
verified) along with its own blocks.
"""

from concurrent.futures import Future, wait
from typing import Protocol

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvtier.errors import StorageError
from kvtier.kv.budget import TierCapacity
from kvtier.kv.contract import DiskFile, KVCache, StoredInPlace
from kvtier.storage import K, V, IOEngine, IOStats, KVBlockFile, aligned_buffer


class StoredPrefix(StoredInPlace, Protocol):
    """The first `tokens` tokens' K/V of every layer, kept on disk elsewhere (kvtier.docstore.entry.StoredKV)."""

    tokens: int

    def submit(self, layer: int, tokens: int, io: IOEngine) -> Future[tuple[torch.Tensor, torch.Tensor]]:
        """Read `layer`'s first `tokens` tokens: K, V [1, heads, tokens, head_dim], verified; one read at a time, its
        tensors copied out before the next."""

    def close(self) -> None: ...


class TieredStore:
    """The disk tier shared by all tiered layers: one block file, one staging buffer, one prefetch in flight, and
    optionally a stored prefix (`base`, for batch 1) whose tokens are read in place instead of written again."""

    def __init__(self, file: KVBlockFile, tier_of_layer: dict[int, int], batch_size: int,
                 base: StoredPrefix | None = None):
        self.file = file
        self.layout = file.layout
        self.tier_of_layer = tier_of_layer  # model layer index -> index in the file
        self.batch_size = batch_size
        self.blocks_per_seq = self.layout.num_blocks // batch_size
        self.stored_blocks = {layer: 0 for layer in tier_of_layer}  # in the file
        self.base = base
        self.base_tokens = {layer: 0 for layer in tier_of_layer}  # the oldest stored tokens: read from `base`
        geometry = self.layout.geometry
        self._block_shape = (self.layout.block_tokens, geometry.num_kv_heads, geometry.head_dim)
        self._torch_dtype = getattr(torch, geometry.dtype)
        self._staging = aligned_buffer(2 * batch_size * self.blocks_per_seq * self.layout.block_bytes)
        self._pending: tuple[int, list[Future]] | None = None

    def stored_tokens(self, layer: int) -> int:
        """Tokens per sequence of `layer` on disk: the base's, then the file's."""
        return self.base_tokens[layer] + self.stored_blocks[layer] * self.layout.block_tokens

    # -- reading ---------------------------------------------------------------------------------------------
    def _staging_slot(self, kind: int, seq: int, block: int, num_blocks: int) -> np.ndarray:
        start = ((kind * self.batch_size + seq) * num_blocks + block) * self.layout.block_bytes
        return self._staging[start : start + self.layout.block_bytes]

    def _read_plan(self, layer: int) -> list[tuple[int, int, int, np.ndarray]]:
        tier, count = self.tier_of_layer[layer], self.stored_blocks[layer]
        return [
            (tier, kind, seq * self.blocks_per_seq + block, self._staging_slot(kind, seq, block, count))
            for kind in (K, V)
            for seq in range(self.batch_size)
            for block in range(count)
        ]

    def _submit(self, layer: int) -> list[Future]:
        """Start the reads of `layer`'s stored tokens: the base's, then the file's (each only if it holds some)."""
        reads = []
        if self.base_tokens[layer]:
            reads.append(self.base.submit(layer, self.base_tokens[layer], self.file.io))
        if self.stored_blocks[layer]:
            reads.append(self.file.submit_read_blocks(self._read_plan(layer)))
        return reads

    def prefetch(self, layer: int) -> None:
        """Start reading `layer`'s stored tokens (no-op when it has none)."""
        if self.stored_tokens(layer):
            self._pending = (layer, self._submit(layer))

    def load(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`layer`'s stored K and V as [batch, heads, tokens, head_dim] parts in token order (the base's, then views
        of the staging buffer); none when it has no stored tokens."""
        if not self.stored_tokens(layer):
            return []
        if self._pending is not None and self._pending[0] == layer:
            reads = self._pending[1]
        else:
            self.wait()
            reads = self._submit(layer)
        self._pending = None
        wait(reads)  # both finished before either raises: no read into a buffer outlives this call
        parts = [reads.pop(0).result()] if self.base_tokens[layer] else []
        if reads:
            reads[0].result()
            count = self.stored_blocks[layer]
            parts.append((self._as_tensor(K, count), self._as_tensor(V, count)))
        return parts

    def _as_tensor(self, kind: int, count: int) -> torch.Tensor:
        nbytes = self.batch_size * count * self.layout.block_bytes
        start = kind * nbytes
        flat = torch.from_numpy(self._staging[start : start + nbytes]).view(self._torch_dtype)
        tokens = flat.view(self.batch_size, count * self._block_shape[0], *self._block_shape[1:])
        return tokens.permute(0, 2, 1, 3)  # stored token-major; attention wants head-major

    def wait(self) -> None:
        """Finish any prefetch in flight (before writing or closing); its errors are left to `load`, which reads the
        layer again."""
        if self._pending is not None:
            wait(self._pending[1])
            self._pending = None

    # -- writing ---------------------------------------------------------------------------------------------
    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store whole blocks of [batch, heads, n*T, head_dim] K/V after `layer`'s stored tokens: those the base
        already holds are counted into it, the rest are written after the layer's blocks in the file."""
        adopted = self._in_base(layer, keys.shape[-2])
        self.base_tokens[layer] += adopted
        keys, values = keys[..., adopted:, :], values[..., adopted:, :]
        first = self.stored_blocks[layer]
        count = keys.shape[-2] // self.layout.block_tokens
        if not count:
            return
        if first + count > self.blocks_per_seq:
            raise StorageError(
                f"{self.file.path}: KV file full ({self.blocks_per_seq * self.layout.block_tokens} tokens per sequence); "
                "create the cache with a larger max_tokens"
            )
        self.wait()
        writes = []
        for kind, tensor in ((K, keys), (V, values)):
            token_major = tensor.permute(0, 2, 1, 3).contiguous().cpu()
            raw = token_major.view(torch.uint8).numpy().reshape(self.batch_size, count, self.layout.block_bytes)
            tier = self.tier_of_layer[layer]
            writes += [
                (tier, kind, seq * self.blocks_per_seq + first + block, raw[seq, block])
                for seq in range(self.batch_size)
                for block in range(count)
            ]
        self.file.write_blocks(writes)
        self.stored_blocks[layer] = first + count

    def _in_base(self, layer: int, count: int) -> int:
        """How many of `count` tokens about to be stored the base holds: whole blocks within its prefix, and only
        while the file holds none of the layer (the base's tokens must come first)."""
        if self.base is None or self.stored_blocks[layer]:
            return 0
        room = (self.base.tokens - self.base_tokens[layer]) // self.layout.block_tokens * self.layout.block_tokens
        return max(0, min(count, room))

    def close(self) -> None:
        self.wait()
        self.file.remove()
        if self.base is not None:
            self.base.close()  # the store's entry: closed, never removed


class OffloadLayer(CacheLayerMixin):
    """One full-attention layer's KV across device, host and disk."""

    is_sliding = False

    def __init__(self, layer_idx: int, store: TieredStore, capacity: TierCapacity, next_layer: int, host_device="cpu"):
        super().__init__()
        self.layer_idx = layer_idx
        self.store = store
        self.capacity = capacity
        self.next_layer = next_layer
        self.host_device = torch.device(host_device)
        self.host_keys = self.host_values = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        empty = key_states[..., :0, :]
        self.keys, self.values = empty, empty
        self.host_keys = self.host_values = empty.to(self.host_device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        full_keys, full_values = self._assemble()
        self.store.prefetch(self.next_layer)  # overlaps this layer's attention; staging is free again
        self._spill()
        return full_keys, full_values

    def _assemble(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[storage | host | device] K and V on the compute device, in token order."""
        parts_k, parts_v = [], []
        for keys, values in self.store.load(self.layer_idx):
            parts_k.append(keys.to(self.device))
            parts_v.append(values.to(self.device))
        parts_k += [self.host_keys.to(self.device), self.keys]
        parts_v += [self.host_values.to(self.device), self.values]
        return torch.cat(parts_k, dim=-2), torch.cat(parts_v, dim=-2)

    def _spill(self) -> None:
        """Move whole oldest blocks device -> host, then host -> disk, until both fit their capacity."""
        move = _tokens_over(self.keys.shape[-2], self.capacity.device_tokens, self.capacity.block_tokens)
        if move:
            self.host_keys = torch.cat([self.host_keys, self.keys[..., :move, :].to(self.host_device)], dim=-2)
            self.host_values = torch.cat([self.host_values, self.values[..., :move, :].to(self.host_device)], dim=-2)
            self.keys, self.values = self.keys[..., move:, :].clone(), self.values[..., move:, :].clone()
        move = _tokens_over(self.host_keys.shape[-2], self.capacity.host_tokens, self.capacity.block_tokens)
        if move:
            self.store.append(self.layer_idx, self.host_keys[..., :move, :], self.host_values[..., :move, :])
            self.host_keys = self.host_keys[..., move:, :].clone()
            self.host_values = self.host_values[..., move:, :].clone()

    def tier_tokens(self) -> dict[str, int]:
        """Tokens per sequence in each tier."""
        if not self.is_initialized:
            return {"device": 0, "host": 0, "storage": 0}
        return {"device": self.keys.shape[-2], "host": self.host_keys.shape[-2],
                "storage": self.store.stored_tokens(self.layer_idx)}

    def get_seq_length(self) -> int:
        return sum(self.tier_tokens().values())

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.store.blocks_per_seq * self.capacity.block_tokens


def _tokens_over(count: int, capacity: int, block_tokens: int) -> int:
    """Tokens (a whole number of blocks) to move so that `count` fits in `capacity`."""
    excess = count - capacity
    return 0 if excess <= 0 else -(-excess // block_tokens) * block_tokens


class OffloadCache(Cache, KVCache):
    """Cache for `model(..., cache=...)` / `model.generate(cache=...)` with full-attention layers tiered to disk.

    Sliding-window layers (Gemma 3) keep their bounded window on the device.
    """

    def __init__(self, layers: list, store: TieredStore):
        super().__init__(layers=layers)
        self.store = store

    def io_stats(self) -> IOStats:
        """Bytes read from and written to the KV file so far."""
        return self.store.file.io.stats.snapshot()

    def storage_files(self) -> list[DiskFile]:
        return [self.store.file]

    def stored_in_place(self) -> StoredInPlace | None:
        """The stored prefix whose K/V the layers read from its entry (batch 1 only)."""
        return self.store.base

    def close(self) -> None:
        """Finish pending I/O and delete the KV file."""
        self.store.close()
