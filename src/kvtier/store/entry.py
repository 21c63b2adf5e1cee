"""One stored prefix's K/V records on disk (`kv.bin`): written as a prefill produces them, read back verified.

kv.bin is block-major: block 0's records of layer 0 (K, then V), of layer 1, ...,
then block 1's. A record is one layer's K or V for `block_tokens` tokens,
[heads, tokens, head_dim] in the model's dtype, padded to 4 KiB so that O_DIRECT
reads start and end on pages. So a prefix of m blocks is the file's first
m * block_span bytes, and one layer's part of it is m runs of two records.

Its meta.json (meta.py) holds every record's crc32c. An entry is written into a
temporary directory and renamed into place only once both files and the
directory are fsynced: a reader finds a complete entry or none.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from kvtier.storage import PAGE, IOEngine, aligned_buffer, checksum, open_direct, round_up
from kvtier.store.meta import KV, META, CorruptEntry, EntryMeta, fsync_directory

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EntryWriter:
    """Builds one entry in `directory` from a prefill's K/V updates; whole blocks are written as they complete."""

    def __init__(self, directory: Path, meta: EntryMeta) -> None:
        self.directory, self.meta = directory, meta
        directory.mkdir()
        self._fd = os.open(directory / KV, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in meta.layers]
        self._written = 0  # blocks
        self.failure: OSError | None = None  # a write failed (full disk...): the entry is dropped, the prompt goes on

    @property
    def blocks_written(self) -> int:
        return self._written

    def add(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One layer's K/V [1, heads, n, head_dim] for the next n prompt tokens."""
        if self.failure is not None:
            return
        self._pending[layer].append((keys[0].detach().cpu(), values[0].detach().cpu()))
        try:
            while min(_pending_tokens(pending) for pending in self._pending) >= self.meta.block_tokens:
                self._write_block()
        except OSError as error:
            self.failure = error
            self._pending = [[] for _ in self.meta.layers]

    def _write_block(self) -> None:
        for layer, pending in enumerate(self._pending):
            keys, values = _take_tokens(pending, self.meta.block_tokens)
            self.meta.layers[layer] = [keys.shape[0], keys.shape[2]]
            for record in (keys, values):
                data = record.contiguous().view(torch.uint8).numpy().tobytes()
                self.meta.crc32c.append(checksum(data))
                os.write(self._fd, data + bytes(round_up(len(data), PAGE) - len(data)))
        self._written += 1

    def finish(self, block_keys: list[str]) -> None:
        """Write meta.json for the blocks written (their keys are the first of `block_keys`) and fsync it all."""
        self.meta.blocks = block_keys[: self._written]
        self.meta.created = time.time()
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        meta_fd = os.open(self.directory / META, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(meta_fd, self.meta.to_bytes())
            os.fsync(meta_fd)
        finally:
            os.close(meta_fd)
        fsync_directory(self.directory)

    def abandon(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_layers(directory: Path, meta: EntryMeta, blocks: int, io: IOEngine) -> Iterator[tuple[int, torch.Tensor,
                                                                                                  torch.Tensor]]:
    """(layer, K, V [1, heads, blocks * block_tokens, head_dim]) of the first `blocks` blocks, every record verified
    (O_DIRECT where the filesystem allows it)."""
    fd, _ = open_direct(directory / KV, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < blocks * meta.block_span:
            raise CorruptEntry(f"{directory / KV}: truncated ({os.fstat(fd).st_size} bytes, "
                               f"{blocks * meta.block_span} needed)")
        for layer in range(len(meta.layers)):
            yield (layer, *_read_layer(fd, directory, meta, blocks, layer, io))
    finally:
        os.close(fd)


def _read_layer(fd: int, directory: Path, meta: EntryMeta, blocks: int, layer: int,
                io: IOEngine) -> tuple[torch.Tensor, torch.Tensor]:
    span, size = meta.record_span(layer), meta.record_bytes(layer)
    buffer = aligned_buffer(blocks * 2 * span)
    io.read_runs(fd, [(meta.layer_offset(block, layer), [memoryview(buffer[2 * block * span : 2 * (block + 1) * span])])
                      for block in range(blocks)])
    records = buffer.reshape(blocks, 2, span)[:, :, :size]
    layers = len(meta.layers)
    for block in range(blocks):
        for kind in (0, 1):
            if checksum(np.ascontiguousarray(records[block, kind])) != meta.crc32c[(block * layers + layer) * 2 + kind]:
                raise CorruptEntry(f"{directory / KV}: block {block} layer {layer} {'KV'[kind]} fails its checksum")
    heads, head_dim = meta.layers[layer]
    tokens = torch.from_numpy(records).view(DTYPES[meta.dtype]).reshape(blocks, 2, heads, meta.block_tokens, head_dim)
    keys, values = (tokens[:, kind].permute(1, 0, 2, 3).reshape(1, heads, blocks * meta.block_tokens, head_dim)
                    for kind in (0, 1))
    return keys, values


def _pending_tokens(pending: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(keys.shape[1] for keys, _ in pending)


def _take_tokens(pending: list[tuple[torch.Tensor, torch.Tensor]], count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `count` tokens' K/V [heads, count, head_dim] of a layer's pending updates, removed from them."""
    keys, values = torch.cat([k for k, _ in pending], dim=1), torch.cat([v for _, v in pending], dim=1)
    pending[:] = [(keys[:, count:], values[:, count:])] if keys.shape[1] > count else []
    return keys[:, :count], values[:, :count]
