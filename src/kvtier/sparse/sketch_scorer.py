"""Score one layer's cold-pool sketches for every sequence, streaming score blocks into the channel.

Runs inside the storage-side scorer process, and in the host as the fault
fallback: one code path, so a fallback produces bit-identical scores and the
generation continues exactly as it would have.

Per sequence the used prefix of the layer's sketch region is read in large
page-aligned chunks, all submitted at once, and scored in order as chunks
land, so disk reads overlap the inner products. After every score block of
`block_tokens` tokens the sequence's progress counter is bumped; a host that
sees the scorer die resumes from there instead of starting over.

`memory_budget` emulates a computational SSD's on-board DRAM: sketches of
regions that fit are kept after their first read and reused while the host
has not rewritten that layer (its version counter in the channel). 0 (the
default) keeps nothing: every step reads the disk.
"""

from __future__ import annotations

import math
import os
import signal
from concurrent.futures import Future

import numpy as np

from kvtier.sparse.protocol import CONTROL_COLD_TOKENS, CONTROL_SCORER_READ_BYTES, Channel
from kvtier.sparse.record_file import RecordLayout
from kvtier.sparse.sketch import SketchFormat, score
from kvtier.storage import PAGE, IOEngine, aligned_buffer
from kvtier.storage.io_engine import then

CHUNK_TARGET_BYTES = 256 * 1024  # large enough to stream, small enough to start scoring early


class SketchScorer:
    """Reads sketches through `fd` and writes `<position, score>` blocks into `channel.results`."""

    def __init__(self, fd: int, layout: RecordLayout, fmt: SketchFormat, channel: Channel, aggregation: str,
                 block_tokens: int, io: IOEngine, memory_budget: int = 0, crash_after_blocks: int = -1) -> None:
        self.fd = fd
        self.layout = layout
        self.fmt = fmt
        self.channel = channel
        self.aggregation = aggregation
        self.block_tokens = block_tokens
        self.io = io
        self.memory_budget = memory_budget
        self.crash_after_blocks = crash_after_blocks  # fault injection for tests only (-1: never)
        self._blocks_scored = 0
        self._cached: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        self._cached_bytes = 0
        # Chunks hold a whole number of records and pages: lcm(record, page) bytes is the smallest such unit.
        unit = math.lcm(layout.record_bytes, PAGE)
        self._chunk_records = max(1, CHUNK_TARGET_BYTES // unit) * unit // layout.record_bytes
        self._buffer = aligned_buffer(layout.region_stride)

    def score_layer(self, layer: int, resume: bool = False) -> None:
        """Score every sequence's cold tokens of `layer`; with `resume`, skip blocks already reported."""
        count = int(self.channel.control[CONTROL_COLD_TOKENS])
        for seq in range(self.layout.batch):
            if not resume:
                self.channel.progress[seq] = 0
            self._score_sequence(layer, seq, count)

    def _score_sequence(self, layer: int, seq: int, count: int) -> None:
        blocks = -(-count // self.block_tokens)
        done = int(self.channel.progress[seq])
        if done >= blocks:
            return
        records, chunks = self._records(layer, seq, count, done * self.block_tokens)
        query = np.ascontiguousarray(self.channel.query[seq])
        positions = self.channel.positions[layer, seq]
        results = self.channel.results[seq]
        from_disk = bool(chunks)
        ready = 0 if from_disk else count
        for block in range(done, blocks):
            lo, hi = block * self.block_tokens, min(count, (block + 1) * self.block_tokens)
            while ready < hi:  # wait for the chunk read that completes this block
                ready = chunks.pop(0).result()
            results["position"][lo:hi] = positions[lo:hi]
            results["score"][lo:hi] = score(records[lo:hi], query, self.fmt, self.aggregation)
            self.channel.progress[seq] = block + 1  # after the block's data: the host may read it from now on
            self._maybe_crash()
        if from_disk and not done:  # a resumed read lacks the blocks before `done`
            self._remember(layer, seq, records)

    def _records(self, layer: int, seq: int, count: int, first: int) -> tuple[np.ndarray, list[Future]]:
        """The region's records (cached, or landing in the read buffer) and one future per chunk still read.

        Each future yields the number of records available once it completes.
        """
        rec = self.layout.record_bytes
        version = int(self.channel.versions[layer])
        cached = self._cached.get((layer, seq))
        if cached is not None and cached[0] == version and len(cached[1]) >= count:
            return cached[1], []
        base = self.layout.region_offset(layer, seq)
        chunks: list[Future] = []
        for lo in range(first // self._chunk_records * self._chunk_records, count, self._chunk_records):
            hi = min(count, lo + self._chunk_records)
            view = memoryview(self._buffer[lo * rec : self.layout.prefix_bytes(hi)])
            self.channel.control[CONTROL_SCORER_READ_BYTES] += view.nbytes
            chunks.append(then(self.io.submit_read_runs(self.fd, [(base + lo * rec, [view])]), _constant(hi)))
        return self._buffer[: count * rec].reshape(count, rec), chunks

    def _remember(self, layer: int, seq: int, records: np.ndarray) -> None:
        """Keep this region's freshly read sketches if the emulated on-board memory has room."""
        old = self._cached.pop((layer, seq), None)
        if old is not None:
            self._cached_bytes -= old[1].nbytes
        if not len(records) or self._cached_bytes + records.nbytes > self.memory_budget:
            return
        self._cached[(layer, seq)] = (int(self.channel.versions[layer]), records.copy())
        self._cached_bytes += records.nbytes

    def _maybe_crash(self) -> None:
        self._blocks_scored += 1
        if self._blocks_scored == self.crash_after_blocks:
            os.kill(os.getpid(), signal.SIGKILL)


def _constant(value: int):
    return lambda: value
