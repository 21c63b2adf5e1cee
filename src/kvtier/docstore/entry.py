"""One stored prefix's K/V on disk (`kv.bin`): written as a prefill produces it, read back verified and in place.

kv.bin is one run per (layer, K | V, head) holding that head's [tokens, head_dim]
for every stored block in order, in the model's dtype. A record, one head's K or
V of one block, is a whole number of 4 KiB pages (meta.check_layout), so the
first m blocks of a layer are 2 x heads runs that O_DIRECT reads straight into a
[2, heads, m x block_tokens, head_dim] tensor: nothing is permuted or copied
between the disk and the cache. The file's size is known from the start (the
prompt's whole blocks), so blocks are written where they belong as they complete.

`read_layers` reads a prefix back layer by layer for a replay; `StoredKV` keeps
the file open for a cache that reads the prefix where it lies, step after step
(`--kv offload`).

Its meta.json (meta.py) holds every record's crc32c. An entry is written into a
temporary directory and renamed into place only once both files and the
directory are fsynced: a reader finds a complete entry or none.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, wait
from pathlib import Path

import numpy as np
import torch

from kvtier.storage import IOEngine, aligned_buffer, checksum, fsync_directory, open_direct, write_new_file
from kvtier.storage.checksum import unit_checksums
from kvtier.storage.file_lock import FileLock
from kvtier.storage.io_engine import then
from kvtier.docstore.meta import KV, META, CorruptEntry, EntryMeta

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EntryWriter:
    """Builds one entry in `directory` from a prefill's K/V updates; whole blocks are written as they complete.

    `meta` comes with every block key and layer shape of the prompt; its checksums fill in as blocks are written.
    """

    def __init__(self, directory: Path, meta: EntryMeta) -> None:
        meta.check_layout()
        self.directory, self.meta = directory, meta
        meta.crc32c = [0] * (len(meta.blocks) * sum(2 * heads for heads, _ in meta.layers))
        directory.mkdir()
        # locked like every file kvtier writes; released (its lock file deleted) before the entry is published
        self._lock = FileLock.acquire(directory / KV, "KV store entry file")
        try:
            self._fd = os.open(directory / KV, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except BaseException:
            self._lock.release()
            raise
        self._pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in meta.layers]
        self._written = 0  # blocks
        self.failure: OSError | None = None  # a write failed (full disk...): the entry is dropped, the prompt goes on

    @property
    def blocks_written(self) -> int:
        return self._written

    def add(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One layer's K/V [1, heads, n, head_dim] for the next n prompt tokens (past the last block: ignored)."""
        if self.failure is not None or self._written == len(self.meta.blocks):
            return
        if [keys.shape[1], keys.shape[3]] != self.meta.layers[layer]:  # not the shape the file was laid out for
            self.failure = OSError(0, f"layer {layer} K/V of shape {tuple(keys.shape)}, {self.meta.layers[layer]} expected")
            return
        self._pending[layer].append((keys[0].detach().cpu(), values[0].detach().cpu()))
        try:
            while self._written < len(self.meta.blocks) and min(map(_pending_tokens, self._pending)) >= self.meta.block_tokens:
                self._write_block()
        except OSError as error:
            self.failure = error
            self._pending = [[] for _ in self.meta.layers]

    def _write_block(self) -> None:
        meta, block = self.meta, self._written
        for layer, pending in enumerate(self._pending):
            for kind, record in enumerate(_take_tokens(pending, meta.block_tokens)):
                for head in range(record.shape[0]):
                    data = record[head].contiguous().view(torch.uint8).numpy()
                    meta.crc32c[meta.record_index(layer, kind, head, block)] = checksum(data)
                    os.pwrite(self._fd, data, meta.region_offset(layer, kind, head) + block * meta.record_bytes(layer))
        self._written += 1

    def finish(self) -> None:
        """Write meta.json and fsync it all; only an entry with every block written may be finished."""
        if self._written != len(self.meta.blocks):
            raise OSError(0, f"only {self._written} of {len(self.meta.blocks)} blocks were written")
        self.meta.created = time.time()
        os.fsync(self._fd)
        self._close()
        write_new_file(self.directory / META, self.meta.to_bytes())
        fsync_directory(self.directory)

    def abandon(self) -> None:
        """Stop writing (idempotent); the directory stays for the store to drop."""
        self._close()

    def _close(self) -> None:
        """Close kv.bin and give up its lock."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._lock.release()


def read_layers(directory: Path, meta: EntryMeta, blocks: int, io: IOEngine) -> Iterator[tuple[int, torch.Tensor,
                                                                                                  torch.Tensor]]:
    """(layer, K, V [1, heads, blocks * block_tokens, head_dim]) of the first `blocks` blocks, every record verified
    (O_DIRECT where the filesystem allows it). The next layer is read while the caller uses this one."""
    stored = StoredKV(directory, meta, blocks * meta.block_tokens)
    reading: _LayerRead | None = None
    try:
        reading = _LayerRead(stored.fd, meta, blocks, 0, io)
        for layer in range(len(meta.layers)):
            buffer = reading.result()
            reading = _LayerRead(stored.fd, meta, blocks, layer + 1, io) if layer + 1 < len(meta.layers) else None
            yield (layer, *stored.verified(buffer, blocks, layer))
    finally:
        if reading is not None:
            reading.settle()  # the descriptor stays open until no thread reads through it
        stored.close()


class StoredKV:
    """An entry's kv.bin opened to read the first `tokens` tokens of its layers, every record verified.

    `submit` serves a cache that keeps the stored prefix where it lies (`--kv offload`): the descriptor stays open
    until `close`, so the entry stays readable even if it is evicted or removed meanwhile (an unlinked open file
    keeps its data), and the file is never written.
    """

    def __init__(self, directory: Path, meta: EntryMeta, tokens: int) -> None:
        self.directory, self.meta, self.tokens = directory, meta, tokens
        self.bytes_read = 0  # opening reads nothing: the records are read per step, counted by the cache's I/O
        try:
            self.fd, _ = open_direct(directory / KV, os.O_RDONLY)
        except FileNotFoundError:  # removed by another process since the lookup
            raise CorruptEntry(f"KV store entry {directory.name} disappeared before it was read") from None
        size = os.fstat(self.fd).st_size
        if size != meta.nbytes:
            self.close()
            raise CorruptEntry(f"{directory / KV}: truncated ({size} bytes of {meta.nbytes})")
        self._crc32c = np.asarray(meta.crc32c, dtype=np.uint32)
        self._buffer: np.ndarray | None = None  # `submit`'s, for the largest layer's blocks of `tokens`

    def submit(self, layer: int, tokens: int, io: IOEngine) -> Future[tuple[torch.Tensor, torch.Tensor]]:
        """Start reading `layer`'s first `tokens` (at most `self.tokens`) tokens; the future gives their K, V
        [1, heads, tokens, head_dim], verified, as views of one buffer that the next `submit` reuses: one read at a
        time, its tensors copied out before the next."""
        blocks = -(-tokens // self.meta.block_tokens)
        if self._buffer is None:
            most = -(-self.tokens // self.meta.block_tokens)
            self._buffer = aligned_buffer(max(2 * heads * most * self.meta.record_bytes(index)
                                              for index, (heads, _) in enumerate(self.meta.layers)))
        reading = _LayerRead(self.fd, self.meta, blocks, layer, io, self._buffer)

        def verified() -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = self.verified(reading.buffer, blocks, layer)
            return keys[:, :, :tokens], values[:, :, :tokens]

        return then(reading.future, verified)

    def verified(self, buffer: np.ndarray, blocks: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one layer's records read into `buffer` [2, heads, blocks, record], after every record is checked
        against its crc."""
        meta = self.meta
        heads, head_dim = meta.layers[layer]
        record = meta.record_bytes(layer)
        for kind in (0, 1):
            for head in range(heads):
                first = meta.record_index(layer, kind, head, 0)  # a head's blocks are consecutive records
                found = unit_checksums(buffer[kind, head].reshape(-1), record)
                bad = np.flatnonzero(found != self._crc32c[first : first + blocks])
                if bad.size:
                    raise CorruptEntry(f"{self.directory / KV}: block {bad[0]} layer {layer} {'KV'[kind]} head {head} "
                                       "fails its checksum")
        tokens = torch.from_numpy(buffer).view(DTYPES[meta.dtype]).reshape(2, 1, heads, blocks * meta.block_tokens,
                                                                           head_dim)
        return tokens[0], tokens[1]

    def holds(self, error: Exception) -> bool:
        """Whether `error` is about this entry's files (storage errors name their file first)."""
        return str(error).startswith(f"{self.directory}{os.sep}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _LayerRead:
    """One layer's records of the first `blocks` blocks, being read into a [2, heads, blocks, record] buffer (the
    start of `into` when given, else a new one)."""

    def __init__(self, fd: int, meta: EntryMeta, blocks: int, layer: int, io: IOEngine,
                 into: np.ndarray | None = None) -> None:
        heads, _ = meta.layers[layer]
        nbytes = 2 * heads * blocks * meta.record_bytes(layer)
        self.buffer = (aligned_buffer(nbytes) if into is None else into[:nbytes]).reshape(2, heads, blocks, -1)
        self.future = io.submit_read_runs(fd, [(meta.region_offset(layer, kind, head),
                                                [memoryview(self.buffer[kind, head].reshape(-1))])
                                               for kind in (0, 1) for head in range(heads)])

    def result(self) -> np.ndarray:
        self.future.result()
        return self.buffer

    def settle(self) -> None:
        wait([self.future])


def _pending_tokens(pending: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(keys.shape[1] for keys, _ in pending)


def _take_tokens(pending: list[tuple[torch.Tensor, torch.Tensor]], count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `count` tokens' K/V [heads, count, head_dim] of a layer's pending updates, removed from them.

    Views of the first update where it holds them: joining every pending update per block would copy the rest of a
    long one (a replayed prefix) once per block."""
    if pending[0][0].shape[1] < count:  # the block straddles updates: join them
        pending[:] = [(torch.cat([k for k, _ in pending], dim=1), torch.cat([v for _, v in pending], dim=1))]
    keys, values = pending[0]
    pending[:1] = [(keys[:, count:], values[:, count:])] if keys.shape[1] > count else []
    return keys[:, :count], values[:, :count]
