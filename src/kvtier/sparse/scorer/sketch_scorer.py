"""Score one layer's cold-pool sketches for every sequence, streaming score blocks into the channel.

Runs inside the storage-side scorer process, and in the host as the fault
fallback: one code path, so a fallback produces bit-identical scores and the
generation continues exactly as it would have.

A layer's sketches are read (one large page-aligned read per sequence, all
sequences in flight together) and scored from their codes (sketch.py). The
scorer process knows the layer order: it *prepares* layer l + 1 while the
host computes up to that layer's query, reading its sketches on a thread of
their own into the second of two buffer sets, so the read may also overlap
the scoring of layer l (scorer_process.py says when it starts), one
sequence at a time and only while no candidate read is in flight
(candidates_first.py): the host waits for those. A prepared
layer is used only while the host has not rewritten it (its version counter
and cold-token count in the channel are unchanged); otherwise the request
reads the disk.

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
import sys
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from kvtier.sparse.scorer.candidates_first import CandidatesFirst
from kvtier.sparse.protocol import CONTROL_SCORER_READ_BYTES, Channel
from kvtier.sparse.record_file import RecordLayout
from kvtier.sparse.cold.sketch import SketchFormat, score
from kvtier.sparse.scorer.stored_sketches import StoredSketches
from kvtier.storage import IOEngine, aligned_buffer


@dataclass
class PreparedLayer:
    """A layer's sketch records per sequence, read (or being read) into buffer set `buffers`, valid for one
    (version, cold-token count)."""

    layer: int
    version: int
    count: int
    buffers: int
    reading: Future  # -> list of uint8 [count, record_bytes], one per sequence

    def current(self, layer: int, version: int, count: int) -> bool:
        """Whether these are `layer`'s sketches as the host last published them."""
        return (self.layer, self.version, self.count) == (layer, version, count)

    def records(self) -> list[np.ndarray] | None:
        """The records once read; None if the read failed (reported on stderr: the request reads again)."""
        try:
            return self.reading.result()
        except Exception:
            traceback.print_exc(file=sys.stderr)
            return None


class SketchScorer:
    """Reads sketches through `fd` and writes `<position, score>` blocks into `channel.results`."""

    def __init__(self, fd: int, layout: RecordLayout, fmt: SketchFormat, channel: Channel, aggregation: str,
                 block_tokens: int, io: IOEngine, memory_budget: int = 0, crash_after_blocks: int = -1,
                 stored: StoredSketches | None = None, prefetch_io: IOEngine | None = None,
                 first: CandidatesFirst | None = None) -> None:
        """`prefetch_io`: the engine prepared layers are read through (their own, so that the reads a request
        waits for do not queue behind them); default `io`. `first`: the candidate reads in flight, which a
        prepared layer's read waits for before each sequence."""
        self.fd = fd
        self.stored = stored  # a stored image's sketches, read in place where the channel's overlay is 0
        self.layout = layout
        self.fmt = fmt
        self.channel = channel
        self.aggregation = aggregation
        self.block_tokens = block_tokens
        self.io = io
        self.prefetch_io = prefetch_io or io
        self.first = first or CandidatesFirst()
        self.memory_budget = memory_budget
        self.crash_after_blocks = crash_after_blocks  # fault injection for tests only (-1: never)
        self._blocks_scored = 0
        self._prepared: PreparedLayer | None = None
        self.last_read_s = 0.0  # how long the last prepared layer took to read
        self._in_use = 0  # the buffer set the records being scored lie in
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-sketch-prefetch")
        self._cached: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        self._cached_bytes = 0
        self._buffers = [[aligned_buffer(layout.region_stride) for _ in range(layout.batch)] for _ in range(2)]
        self._scores = np.empty(block_tokens, dtype=np.float32)  # one block's scores, before they go to the channel

    def prepare(self, layer: int) -> Future:
        """Start reading `layer`'s sketches ahead of its query into the buffer set not being scored (nothing new if
        they still are current); the returned future completes when they are in."""
        version = int(self.channel.versions[layer])  # before the count and the data: a rewrite since shows
        count = int(self.channel.cold_used[layer])
        prepared = self._prepared
        if prepared is not None and prepared.current(layer, version, count):
            return prepared.reading
        self._settle()  # a read still in flight may be filling the set this one is about to use
        target = 1 - self._in_use
        reading = self._reader.submit(self._timed_load, layer, count, version, target)
        self._prepared = PreparedLayer(layer, version, count, target, reading)
        return reading

    def score_layer(self, layer: int, area: int, count: int, resume: bool = False,
                    then_prepare: int | None = None) -> None:
        """Score `count` cold tokens of `layer` per sequence with request area `area`'s query, into its results; with
        `resume`, skip blocks already reported. With `then_prepare`, that layer's sketches are read meanwhile."""
        progress = self.channel.progress[area]
        if not resume:
            progress[:] = 0
        blocks = -(-count // self.block_tokens)
        pending = [seq for seq in range(self.layout.batch) if progress[seq] < blocks]
        records = self._records(layer, count, pending)
        if then_prepare is not None:
            self.prepare(then_prepare)
        for seq in pending:
            self._score_sequence(layer, area, seq, count, records[seq])

    def close(self) -> None:
        """Wait for a read in flight and stop the reading thread (before the files close)."""
        self._reader.shutdown(wait=True)

    def _records(self, layer: int, count: int, seqs: list[int]) -> dict[int, np.ndarray]:
        """Sketch records of `seqs`: the prepared layer's if it is still current (waiting for its read), else read
        now."""
        prepared, version = self._prepared, int(self.channel.versions[layer])
        if prepared is not None and prepared.current(layer, version, count):
            records = prepared.records()
            if records is not None:
                self._in_use = prepared.buffers
                return {seq: records[seq] for seq in seqs}
        self._settle()  # one read at a time: they share the bookkeeping
        if prepared is not None and prepared.layer == layer:  # stale or failed: its buffers are free
            self._prepared = prepared = None
        self._in_use = 0 if prepared is None else 1 - prepared.buffers  # another layer's stays prepared
        return dict(zip(seqs, self._load(layer, count, version, self._in_use, seqs)))

    def _timed_load(self, layer: int, count: int, version: int, buffers: int) -> list[np.ndarray]:
        started = time.perf_counter()
        records = self._load(layer, count, version, buffers, io=self.prefetch_io, yielding=True)
        self.last_read_s = time.perf_counter() - started
        return records

    def _settle(self) -> None:
        """Let a read in flight finish (its outcome is looked at only if its layer is asked for)."""
        if self._prepared is not None:
            wait([self._prepared.reading])

    def _score_sequence(self, layer: int, area: int, seq: int, count: int, records: np.ndarray) -> None:
        query = np.ascontiguousarray(self.channel.query[area, seq])
        positions = self.channel.positions[layer, seq]
        results, progress = self.channel.results[area, seq], self.channel.progress[area]
        for block in range(int(progress[seq]), -(-count // self.block_tokens)):
            lo, hi = block * self.block_tokens, min(count, (block + 1) * self.block_tokens)
            results["position"][lo:hi] = positions[lo:hi]
            results["score"][lo:hi] = score(records[lo:hi], query, self.fmt, self.aggregation, out=self._scores)
            progress[seq] = block + 1  # after the block's data: the host may read it from now on
            self._maybe_crash()

    def _load(self, layer: int, count: int, version: int, buffers: int, seqs: list[int] | None = None,
              io: IOEngine | None = None, yielding: bool = False) -> list[np.ndarray]:
        """Sketch records of the first `count` cold tokens of each of `seqs` (default: all), read together into
        buffer set `buffers` through `io` (default the request's engine), or with `yielding` one sequence at a
        time once no candidate read is in flight; `version`: the layer's version read before the count (what a
        cached copy is valid for)."""
        seqs = list(range(self.layout.batch)) if seqs is None else seqs
        records: dict[int, np.ndarray] = {}
        from_disk = []
        for seq in seqs:
            cached = self._cached.get((layer, seq))
            if cached is not None and cached[0] == version and len(cached[1]) >= count:
                records[seq] = cached[1][:count]
            else:
                from_disk.append(seq)
                buffer = self._buffers[buffers][seq]
                records[seq] = buffer[: count * self.layout.record_bytes].reshape(count, self.layout.record_bytes)
        if count and from_disk:
            for part in self._parts(from_disk, yielding):
                read = self._read(io or self.io, layer, count, {seq: self._buffers[buffers][seq] for seq in part})
                self.channel.control[CONTROL_SCORER_READ_BYTES] += read
        for seq in from_disk:
            self._remember(layer, seq, version, records[seq])
        return [records[seq] for seq in seqs]

    def _parts(self, seqs: list[int], yielding: bool) -> Iterator[list[int]]:
        """`seqs` read together; or, `yielding`, one at a time, each once no candidate read is in flight."""
        if not yielding:
            yield seqs
            return
        for seq in seqs:
            self.first.wait_quiet()
            yield [seq]

    def _read(self, io: IOEngine, layer: int, count: int, buffers: dict[int, np.ndarray]) -> int:
        """The first `count` sketches of each sequence in `buffers` into its buffer, read together; the bytes
        read."""
        if self.stored is not None:
            return sum(self.stored.read_layered(io, self.fd, self.layout, layer, seq,
                                                self.channel.overlay[layer, seq, :count].copy(), buffer)
                       for seq, buffer in buffers.items())
        nbytes = self.layout.prefix_bytes(count)
        io.read_runs(self.fd, [(self.layout.region_offset(layer, seq), [memoryview(buffer[:nbytes])])
                               for seq, buffer in buffers.items()])
        return nbytes * len(buffers)

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
