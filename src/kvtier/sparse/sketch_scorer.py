"""Score one layer's cold-pool sketches for every sequence, streaming score blocks into the channel.

Runs inside the storage-side scorer process, and in the host as the fault
fallback: one code path, so a fallback produces bit-identical scores and the
generation continues exactly as it would have.

A layer's sketches are read (one large page-aligned read per sequence, all
sequences in flight together) and scored from their codes (sketch.py). The
scorer process knows the layer order: as soon as it has answered layer l it
*prepares* layer l + 1 (reads its sketches), so that read overlaps the host's
computation of layer l + 1 up to its attention, and a query finds them ready. A prepared layer is used only
while the host has not rewritten it (its version counter and cold-token count
in the channel are unchanged); otherwise the request reads the disk.

After every score block of `block_tokens` tokens the sequence's progress
counter is bumped; a host that sees the scorer die resumes from there instead
of starting over.

`memory_budget` emulates a computational SSD's on-board DRAM: sketches of
regions that fit are kept after their first read and reused while the host
has not rewritten that layer. 0 (the default) keeps nothing: every step reads
the disk.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import numpy as np

from kvtier.sparse.protocol import CONTROL_COLD_TOKENS, CONTROL_SCORER_READ_BYTES, Channel
from kvtier.sparse.record_file import RecordLayout
from kvtier.sparse.sketch import SketchFormat, score
from kvtier.sparse.stored_sketches import StoredSketches
from kvtier.storage import IOEngine, aligned_buffer


@dataclass
class PreparedLayer:
    """A layer's sketch records per sequence, valid for one (version, cold-token count)."""

    layer: int
    version: int
    count: int
    records: list[np.ndarray]  # uint8 [count, record_bytes] per sequence

    def current(self, layer: int, version: int, count: int) -> bool:
        """Whether these are `layer`'s sketches as the host last published them."""
        return (self.layer, self.version, self.count) == (layer, version, count)


class SketchScorer:
    """Reads sketches through `fd` and writes `<position, score>` blocks into `channel.results`."""

    def __init__(self, fd: int, layout: RecordLayout, fmt: SketchFormat, channel: Channel, aggregation: str,
                 block_tokens: int, io: IOEngine, memory_budget: int = 0, crash_after_blocks: int = -1,
                 stored: StoredSketches | None = None) -> None:
        self.fd = fd
        self.stored = stored  # a stored image's sketches, read in place where the channel's overlay is 0
        self.layout = layout
        self.fmt = fmt
        self.channel = channel
        self.aggregation = aggregation
        self.block_tokens = block_tokens
        self.io = io
        self.memory_budget = memory_budget
        self.crash_after_blocks = crash_after_blocks  # fault injection for tests only (-1: never)
        self._blocks_scored = 0
        self._prepared: PreparedLayer | None = None
        self._cached: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        self._cached_bytes = 0
        self._buffers = [aligned_buffer(layout.region_stride) for _ in range(layout.batch)]
        self._scores = np.empty(block_tokens, dtype=np.float32)  # one block's scores, before they go to the channel

    def prepare(self, layer: int) -> None:
        """Read `layer`'s sketches now, ahead of its query (nothing to do if they still are current)."""
        version = int(self.channel.versions[layer])  # before the count and the data: a rewrite since shows
        count = int(self.channel.cold_used[layer])
        if self._prepared is not None and self._prepared.current(layer, version, count):
            return
        self._prepared = PreparedLayer(layer, version, count, self._load(layer, count, version))

    def score_layer(self, layer: int, resume: bool = False) -> None:
        """Score every sequence's cold tokens of `layer`; with `resume`, skip blocks already reported."""
        count = int(self.channel.control[CONTROL_COLD_TOKENS])
        if not resume:
            self.channel.progress[:] = 0
        blocks = -(-count // self.block_tokens)
        pending = [seq for seq in range(self.layout.batch) if self.channel.progress[seq] < blocks]
        records = self._records(layer, count, pending)
        for seq in pending:
            self._score_sequence(layer, seq, count, records[seq])

    def _records(self, layer: int, count: int, seqs: list[int]) -> dict[int, np.ndarray]:
        """Sketch records of `seqs`: the prepared layer's if it is still current, else read now."""
        prepared, version = self._prepared, int(self.channel.versions[layer])
        if prepared is not None and prepared.current(layer, version, count):
            return {seq: prepared.records[seq] for seq in seqs}
        self._prepared = None  # its buffers are about to be overwritten
        return dict(zip(seqs, self._load(layer, count, version, seqs)))

    def _score_sequence(self, layer: int, seq: int, count: int, records: np.ndarray) -> None:
        query = np.ascontiguousarray(self.channel.query[seq])
        positions = self.channel.positions[layer, seq]
        results = self.channel.results[seq]
        for block in range(int(self.channel.progress[seq]), -(-count // self.block_tokens)):
            lo, hi = block * self.block_tokens, min(count, (block + 1) * self.block_tokens)
            results["position"][lo:hi] = positions[lo:hi]
            results["score"][lo:hi] = score(records[lo:hi], query, self.fmt, self.aggregation, out=self._scores)
            self.channel.progress[seq] = block + 1  # after the block's data: the host may read it from now on
            self._maybe_crash()

    def _load(self, layer: int, count: int, version: int, seqs: list[int] | None = None) -> list[np.ndarray]:
        """Sketch records of the first `count` cold tokens of each of `seqs` (default: all), read together;
        `version`: the layer's version read before the count (what a cached copy is valid for)."""
        seqs = list(range(self.layout.batch)) if seqs is None else seqs
        records: dict[int, np.ndarray] = {}
        from_disk = []
        for seq in seqs:
            cached = self._cached.get((layer, seq))
            if cached is not None and cached[0] == version and len(cached[1]) >= count:
                records[seq] = cached[1][:count]
            else:
                from_disk.append(seq)
                records[seq] = self._buffers[seq][: count * self.layout.record_bytes].reshape(count, self.layout.record_bytes)
        if count and from_disk:
            self.channel.control[CONTROL_SCORER_READ_BYTES] += self._read(layer, count, from_disk)
        for seq in from_disk:
            self._remember(layer, seq, version, records[seq])
        return [records[seq] for seq in seqs]

    def _read(self, layer: int, count: int, seqs: list[int]) -> int:
        """The first `count` sketches of each of `seqs` into their buffers, read together; the bytes read."""
        if self.stored is not None:
            return sum(self.stored.read_layered(self.io, self.fd, self.layout, layer, seq,
                                                self.channel.overlay[layer, seq, :count].copy(), self._buffers[seq])
                       for seq in seqs)
        nbytes = self.layout.prefix_bytes(count)
        self.io.read_runs(self.fd, [(self.layout.region_offset(layer, seq), [memoryview(self._buffers[seq][:nbytes])])
                                    for seq in seqs])
        return nbytes * len(seqs)

    def _remember(self, layer: int, seq: int, version: int, records: np.ndarray) -> None:
        """Keep this region's freshly read sketches if the emulated on-board memory has room."""
        old = self._cached.pop((layer, seq), None)
        if old is not None:
            self._cached_bytes -= old[1].nbytes
        if not len(records) or self._cached_bytes + records.nbytes > self.memory_budget:
            return
        self._cached[(layer, seq)] = (version, records.copy())
        self._cached_bytes += records.nbytes

    def _maybe_crash(self) -> None:
        self._blocks_scored += 1
        if self._blocks_scored == self.crash_after_blocks:
            os.kill(os.getpid(), signal.SIGKILL)
