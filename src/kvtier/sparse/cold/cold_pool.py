"""The cold pool, host side: two record files in the storage dir and the bookkeeping around them.

    <name>.kv      full-precision K|V of each cold token (one record per token and layer)
    <name>.sketch  its key sketch (sketch.py), read by the storage scorer every step

Both use the same (layer, sequence, slot) regions (record_file.py), so a
cold token's slot indexes both. The position held by each slot lives in the
shared channel, where the scorer reads it to label its score blocks. Every
sequence of a layer holds the same number of cold tokens: they arrive from
the hot pool in equal numbers per sequence, and promotions are swaps.

The host writes (at placement and on demotion), then publishes positions and
the cold-token count and bumps the layer's version, then sends requests; a
scorer therefore never sees a slot whose bytes are not on disk. Writes after
placement (`append_later`, `replace_later`) run on a background thread
(background_writes.py); `settle(layer)` waits for a layer's before it is read. Every page of
the K|V file carries a crc32c, kept in the shared channel (the scorer reads the
lookahead's candidates too) and checked on every read (record_file.py), every
page of a read in one compiled call.

With a `base` (a stored document's image, cold_image.py), `adopt` hands a layer's
first slots to the base's read-only files: the prompt's cold tokens are not
written again. A later write of any slot goes to this pool's own files and sets
the slot's bit in the channel's `overlay` mask, so the image is never modified
(other processes may be reading it); fetches and the scorer read each slot
where its bytes are.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.sparse.cold.background_writes import BackgroundWrites
from kvtier.sparse.protocol import Channel
from kvtier.sparse.record_file import RecordFile, RecordLayout
from kvtier.sparse.cold.sketch import SketchFormat, quantize
from kvtier.sparse.cold.slot_reads import submit_slot_reads
from kvtier.storage import IOEngine
from kvtier.storage.checksum import PageChecksums


@dataclass
class Fetched:
    """A layer's fetched cold tokens: per sequence their slots (ascending); their verified K/V [batch, heads, width,
    head_dim], views of the records where the reads landed, sequence s's own the first len(slots[s]) (the rest
    padding, never chosen); the bytes read."""

    slots: list[np.ndarray]
    keys: torch.Tensor
    values: torch.Tensor
    nbytes: int

    @property
    def counts(self) -> np.ndarray:
        return np.array([len(slots) for slots in self.slots], dtype=np.int64)

    def of(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence `seq`'s own K/V [heads, n, head_dim]."""
        count = len(self.slots[seq])
        return self.keys[seq, :, :count], self.values[seq, :, :count]


class ColdPool:
    """Cold tokens of every tiered layer and sequence; slots 0..used[layer]-1 are occupied."""

    def __init__(self, directory: str, layers: int, batch: int, slots: int, heads: int, head_dim: int,
                 dtype: torch.dtype, fmt: SketchFormat, io: IOEngine, channel: Channel,
                 base: RecordFile | None = None) -> None:
        """`base`: a stored image's K|V records (read-only), the slots `adopt` hands it until they are rewritten."""
        self.heads, self.head_dim, self.dtype, self.fmt = heads, head_dim, dtype, fmt
        self.channel = channel
        self.io = io
        self.base = base
        self.writes = BackgroundWrites()
        self.token_bytes = kv_record_bytes(heads, head_dim, dtype) // 2
        self.stem = stem = os.path.join(directory, f"sparse-{os.getpid()}-{uuid.uuid4().hex[:8]}")  # this run's files
        # the K|V pages' crcs live in the channel: the scorer checks the candidates it reads (candidate_reads.py)
        self.kv = RecordFile(stem + ".kv", RecordLayout(2 * self.token_bytes, layers, batch, slots), io,
                             page_checksums=channel.kv_checksums)
        try:
            # page crcs of the sketches too: a stored image persists them for the scorer (cold_image.py)
            self.sketches = RecordFile(stem + ".sketch", RecordLayout(fmt.record_bytes, layers, batch, slots), io,
                                       page_checksums=PageChecksums)
        except BaseException:
            self.kv.remove()
            raise

    @property
    def positions(self) -> np.ndarray:
        """int32 [layers, batch, slots]: the token position in each cold slot (shared with the scorer)."""
        return self.channel.positions

    @property
    def used(self) -> np.ndarray:
        """int64 [layers]: cold tokens per sequence of each layer (shared with the scorer)."""
        return self.channel.cold_used

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

    def adopt(self, layer: int, positions: np.ndarray) -> None:
        """The first len(positions) slots of `layer` (sequence 0) are the base's, holding tokens at `positions`."""
        count = len(positions)
        self.positions[layer, 0, :count] = positions
        self.channel.overlay[layer, 0, :count] = 0
        self.used[layer] = count
        self.channel.versions[layer] += 1

    def replace(self, layer: int, seq: int, slots: np.ndarray, keys: torch.Tensor, values: torch.Tensor,
                positions: np.ndarray) -> None:
        """Overwrite sequence `seq`'s `slots` with tokens (K/V [heads, n, head_dim]) at `positions`."""
        self._write(layer, seq, slots, keys, values)
        self.positions[layer, seq, slots] = positions
        self.channel.versions[layer] += 1

    def append_later(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: np.ndarray,
                     on_done: Callable[[float], None] | None = None) -> None:
        """`append` on the writer thread (the arguments must not change afterwards); see `settle`."""
        self.writes.submit(layer, lambda: self.append(layer, keys, values, positions), on_done)

    def replace_later(self, layer: int, seq: int, slots: np.ndarray, keys: torch.Tensor, values: torch.Tensor,
                      positions: np.ndarray, on_done: Callable[[float], None] | None = None) -> None:
        """`replace` on the writer thread (the arguments must not change afterwards); see `settle`."""
        self.writes.submit(layer, lambda: self.replace(layer, seq, slots, keys, values, positions), on_done)

    def settle(self, layer: int) -> None:
        """Wait until `layer`'s queued writes are on disk and published (raises the first that failed)."""
        self.writes.settle(layer)

    def _write(self, layer: int, seq: int, slots: np.ndarray, keys: torch.Tensor, values: torch.Tensor) -> None:
        token_keys = keys.transpose(0, 1).contiguous()  # [n, heads, head_dim]: records are token-major
        records = torch.cat([_bytes(token_keys), _bytes(values.transpose(0, 1).contiguous())], dim=1).numpy()
        self.kv.write_records(layer, seq, slots, records)
        self.sketches.write_records(layer, seq, slots, quantize(token_keys.float().numpy(), self.fmt))
        self.channel.overlay[layer, seq, slots] = 1  # before the slots are published: readers go to this run's files

    # ----- reading -----

    def fetch(self, layer: int, seq: int, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Full-precision K/V [heads, n, head_dim] of sequence `seq`'s cold `slots` (checksums verified), bytes read."""
        fetched = self.fetch_many(layer, [slots], [seq])
        return *fetched.of(0), fetched.nbytes

    def fetch_many(self, layer: int, slots_by_seq: list[np.ndarray], seqs: list[int] | None = None) -> Fetched:
        """`fetch` for several sequences of one layer (default 0..n-1), all their reads in flight at once."""
        return self.submit_fetch(layer, slots_by_seq, seqs)()

    def submit_fetch(self, layer: int, slots_by_seq: list[np.ndarray],
                     seqs: list[int] | None = None) -> Callable[[], Fetched]:
        """`fetch_many` with the reads queued now: returns the function that waits for them (the host works meanwhile)."""
        seqs = list(range(len(slots_by_seq))) if seqs is None else seqs
        wait = submit_slot_reads(self.kv, self.base, self.channel.overlay, layer, slots_by_seq, seqs)

        def result() -> Fetched:
            landed = wait()
            block = np.zeros((len(landed), max(len(slots) for slots in slots_by_seq), 2 * self.token_bytes), np.uint8)
            for seq, (records, _) in enumerate(landed):
                block[seq, : len(records)] = records
            return self.fetched(slots_by_seq, block, sum(nbytes for _, nbytes in landed))

        return result

    def fetched(self, slots: list[np.ndarray], records: np.ndarray, nbytes: int) -> Fetched:
        """The K/V of verified records read for `slots` (uint8 [batch, width, record_bytes], sequence s's the first
        len(slots[s])), viewed where they lie, and `nbytes` read for them."""
        batch, width, _ = records.shape
        if not width:  # torch gives an empty byte array a zero stride, which it refuses to reinterpret
            empty = torch.empty(batch, self.heads, 0, self.head_dim, dtype=self.dtype)
            return Fetched(slots, empty, empty.clone(), nbytes)
        tokens = torch.from_numpy(records).view(self.dtype).view(batch, width, 2, self.heads, self.head_dim)
        return Fetched(slots, tokens[:, :, 0].transpose(1, 2), tokens[:, :, 1].transpose(1, 2), nbytes)

    def close(self) -> None:
        self.writes.close()
        self.kv.remove()
        self.kv.pages = None  # views of the channel, which its owner closes next
        self.sketches.remove()
        if self.base is not None:
            self.base.close()  # the stored image's: closed, never removed


def kv_record_bytes(heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's K|V record of one layer."""
    return 2 * heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def _bytes(tokens: torch.Tensor) -> torch.Tensor:
    """[n, heads, head_dim] as uint8 [n, bytes] (works for bfloat16, which numpy lacks)."""
    return tokens.reshape(tokens.shape[0], -1).view(torch.uint8)
