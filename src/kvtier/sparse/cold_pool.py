"""The cold pool, host side: two record files in the storage dir and the bookkeeping around them.

    <name>.kv      full-precision K|V of each cold token (one record per token and layer)
    <name>.sketch  its key sketch (sketch.py), read by the storage scorer every step

Both use the same (layer, sequence, slot) regions (record_file.py), so a
cold token's slot indexes both. The position held by each slot lives in the
shared channel, where the scorer reads it to label its score blocks. Every
sequence of a layer holds the same number of cold tokens: they arrive from
the hot pool in equal numbers per sequence, and promotions are swaps.

The host writes (at placement and on demotion), then publishes positions and
bumps the layer's version, then sends requests; a scorer therefore never sees
a slot whose bytes are not on disk. K|V records carry a crc32c kept in host
memory and checked on every fetch.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import torch

from kvtier.errors import ChecksumError
from kvtier.sparse.protocol import Channel
from kvtier.sparse.record_file import RecordFile, RecordLayout
from kvtier.sparse.sketch import SketchFormat, quantize
from kvtier.storage import IOEngine, checksum


class ColdPool:
    """Cold tokens of every tiered layer and sequence; slots 0..used[layer]-1 are occupied."""

    def __init__(self, directory: str, layers: int, batch: int, slots: int, heads: int, head_dim: int,
                 dtype: torch.dtype, fmt: SketchFormat, io: IOEngine, channel: Channel) -> None:
        self.heads, self.head_dim, self.dtype, self.fmt = heads, head_dim, dtype, fmt
        self.channel = channel
        self.io = io
        self.token_bytes = heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        stem = os.path.join(directory, f"sparse-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.kv = RecordFile(stem + ".kv", RecordLayout(2 * self.token_bytes, layers, batch, slots), io)
        try:
            self.sketches = RecordFile(stem + ".sketch", RecordLayout(fmt.record_bytes, layers, batch, slots), io)
        except BaseException:
            self.kv.remove()
            raise
        self.used = [0] * layers
        self._crc = np.zeros((layers, batch, slots), dtype=np.uint32)

    @property
    def positions(self) -> np.ndarray:
        """int32 [layers, batch, slots]: the token position in each cold slot (shared with the scorer)."""
        return self.channel.positions

    # ----- writing -----

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: np.ndarray) -> None:
        """Store n more tokens per sequence (K/V [batch, heads, n, head_dim]) after the used slots."""
        count = keys.shape[2]
        slots = np.arange(self.used[layer], self.used[layer] + count)
        for seq in range(keys.shape[0]):
            self._write(layer, seq, slots, keys[seq], values[seq])
        self.positions[layer][:, slots] = positions
        self.used[layer] += count
        self.channel.versions[layer] += 1

    def replace(self, layer: int, seq: int, slots: np.ndarray, keys: torch.Tensor, values: torch.Tensor,
                positions: np.ndarray) -> None:
        """Overwrite sequence `seq`'s `slots` with tokens (K/V [heads, n, head_dim]) at `positions`."""
        self._write(layer, seq, slots, keys, values)
        self.positions[layer, seq, slots] = positions
        self.channel.versions[layer] += 1

    def _write(self, layer: int, seq: int, slots: np.ndarray, keys: torch.Tensor, values: torch.Tensor) -> None:
        token_keys = keys.transpose(0, 1).contiguous()  # [n, heads, head_dim]: records are token-major
        records = torch.cat([_bytes(token_keys), _bytes(values.transpose(0, 1).contiguous())], dim=1).numpy()
        self.kv.write_records(layer, seq, slots, records)
        self.sketches.write_records(layer, seq, slots, quantize(token_keys.float().numpy(), self.fmt))
        self._crc[layer, seq, slots] = [checksum(record) for record in records]

    # ----- reading -----

    def fetch(self, layer: int, seq: int, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Full-precision K/V [heads, n, head_dim] of sequence `seq`'s cold `slots` (checksums verified), pages read."""
        return self.fetch_many(layer, [slots], [seq])[0]

    def fetch_many(self, layer: int, slots_by_seq: list[np.ndarray],
                   seqs: list[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """`fetch` for several sequences of one layer (default 0..n-1), all their reads in flight at once."""
        seqs = list(range(len(slots_by_seq))) if seqs is None else seqs
        read = self.kv.read_many(layer, list(zip(seqs, slots_by_seq)))
        return [self._tokens(layer, seq, slots, records, pages)
                for seq, slots, (records, pages) in zip(seqs, slots_by_seq, read)]

    def _tokens(self, layer: int, seq: int, slots: np.ndarray, records: np.ndarray,
                pages: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """K/V of records read for `slots`, after checking each against its checksum."""
        for slot, record in zip(slots, records):
            if checksum(record) != self._crc[layer, seq, slot]:
                raise ChecksumError(f"{self.kv.path}: cold K/V of layer {layer} sequence {seq} slot {slot} does not "
                                    "match its checksum; the file is damaged: rerun the generation")
        if not len(slots):  # torch gives an empty byte array a zero stride, which it refuses to reinterpret
            empty = torch.empty(self.heads, 0, self.head_dim, dtype=self.dtype)
            return empty, empty.clone(), 0
        tokens = torch.from_numpy(records).view(self.dtype).view(len(slots), 2, self.heads, self.head_dim)
        return tokens[:, 0].transpose(0, 1), tokens[:, 1].transpose(0, 1), pages

    def close(self) -> None:
        self.kv.remove()
        self.sketches.remove()


def _bytes(tokens: torch.Tensor) -> torch.Tensor:
    """[n, heads, head_dim] as uint8 [n, bytes] (works for bfloat16, which numpy lacks)."""
    return tokens.reshape(tokens.shape[0], -1).view(torch.uint8)
