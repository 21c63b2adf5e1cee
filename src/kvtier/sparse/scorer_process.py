"""The storage-side scorer: a separate OS process that owns the cold pool's reads beside the data.

It plays the SmartSSD's FPGA (the HillInfer paper's HIE + CEC): per request it reads
one layer's key sketches next to the data, computes raw inner products with
the query found in shared memory, and streams `<position, score>` blocks back.
It never sends keys to the host. For the lookahead's candidates requests it
also reads the best-scored tokens' full-precision K/V and checks them
(candidate_reads.py), so those reads leave the host's critical path too.

Started by `ScorerClient` as `python -m kvtier.sparse.scorer_process CONFIG`,
with the shared segment and both pipes inherited as file descriptors. It
imports numpy and kvtier's storage layer only (no torch), so it starts in a
fraction of a second, and it runs numpy single-threaded: it stands for a small
accelerator beside the disk, not for a second copy of the host's cores.

It knows the layer order: it reads layer l + 1's sketches on a thread and an
I/O engine of their own (sketch_scorer.py), so a query finds them ready. That
read starts once layer l is answered, so the disk serves the request's
candidate reads alone, unless the scorer falls behind the host (the read
would not be done by the next request): then it starts as soon as layer l's
sketches are in hand and overlaps its scoring and candidate reads
(`PrepareTiming`). On start it answers request id 0 (ready). It exits when
the request pipe closes (the host is gone) or on a stop request.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable

from kvtier.sparse.candidate_reads import CandidateReader
from kvtier.sparse.protocol import (
    OP_CANDIDATES, OP_STOP, REQUEST, RESPONSE, STATUS_FAILED, STATUS_OK, Channel, ChannelSpec, read_exact,
)
from kvtier.sparse.record_file import RecordFile, RecordLayout, open_for_reading, stored_pages
from kvtier.sparse.sketch import SketchFormat
from kvtier.sparse.sketch_scorer import SketchScorer
from kvtier.sparse.stored_sketches import StoredSketches
from kvtier.storage import IOEngine
from kvtier.storage.checksum import PageChecksums


class StorageScorer:
    """What the scorer does for a request: score the layer's sketches and, for a candidates request, read the best
    candidates' K/V (candidate_reads.py). The host's fallback builds the same from the same config."""

    def __init__(self, config: dict, channel: Channel, memory_budget: int, crash_after_blocks: int) -> None:
        self.io = IOEngine(config["io_threads"])
        prefetch_io = IOEngine(config["io_threads"])
        self._engines, self._files = [self.io, prefetch_io], []
        self.fd, self.sketches, self.candidates = -1, None, None
        try:
            self.fd, _ = open_for_reading(config["sketch_path"])
            self.sketches = SketchScorer(
                self.fd, RecordLayout(**config["layout"]), SketchFormat(**config["format"]), channel,
                config["aggregation"], config["block_tokens"], self.io, memory_budget=memory_budget,
                crash_after_blocks=crash_after_blocks,
                stored=StoredSketches(config["stored"]) if config.get("stored") else None, prefetch_io=prefetch_io)
            self.candidates = self._candidate_reader(config, channel) if channel.spec.candidates else None
        except BaseException:
            self.close()
            raise

    def _candidate_reader(self, config: dict, channel: Channel) -> CandidateReader:
        kv, stored = config["kv"], config.get("stored_kv")
        layout = RecordLayout(**kv["layout"])
        own = self._file(kv["path"], layout, channel.kv_checksums(layout.file_bytes // kv["page"], kv["page"]), self.io)
        base = None
        if stored:  # a stored image's reads get an engine of their own: one batch in flight per file at a time
            self._engines.append(IOEngine(config["io_threads"]))
            base = self._file(stored["path"], RecordLayout(**stored["layout"]), stored_pages(stored), self._engines[-1])
        return CandidateReader(channel, own, base)

    def _file(self, path: str, layout: RecordLayout, pages: PageChecksums, io: IOEngine) -> RecordFile:
        self._files.append(RecordFile(path, layout, io, stored_pages=pages))
        return self._files[-1]

    def answer(self, layer: int, op: int, resume: bool = False, then_prepare: int | None = None) -> None:
        """Do request `op` for `layer`; with `resume`, skip the score blocks already reported; with `then_prepare`,
        read that layer's sketches meanwhile."""
        self.sketches.score_layer(layer, resume=resume, then_prepare=then_prepare)
        if op == OP_CANDIDATES:
            self.candidates.read(layer)

    def close(self) -> None:
        if self.sketches is not None:
            self.sketches.close()
        for file in self._files:
            file.close()
        if self.sketches is not None and self.sketches.stored is not None:
            self.sketches.stored.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        for engine in self._engines:
            engine.close()


class PrepareTiming:
    """When to start reading the next layer's sketches: after the answer, or overlapping it.

    Overlapped, the read shares the disk with the request's candidate reads, which the host waits for, and
    slows them; it pays only when the scorer is behind. The measure: how much sooner than the next request a
    read started after the answer would have finished (its measured duration), averaged over requests.
    """

    WEIGHT = 0.2  # of the newest request in the average

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.slack_s = 0.0
        self.clock = clock
        self._answered: float | None = None

    def overlap(self) -> bool:
        return self.slack_s < 0

    def answered(self) -> None:
        self._answered = self.clock()

    def arrived(self, read_s: float) -> None:
        """A request came; `read_s`: how long the last sketch read took."""
        if self._answered is not None:
            slack = self.clock() - self._answered - read_s
            self.slack_s += self.WEIGHT * (slack - self.slack_s)


def serve(config: dict) -> None:
    channel = Channel(ChannelSpec(**config["channel"]), config["channel_fd"])
    requests, responses = config["request_fd"], config["response_fd"]
    scorer = StorageScorer(config, channel, config["memory_budget"], config.get("crash_after_blocks", -1))
    timing = PrepareTiming()
    try:
        os.write(responses, RESPONSE.pack(0, STATUS_OK))
        while True:
            message = read_exact(requests, REQUEST.size)
            if not message:
                return
            request_id, layer, op = REQUEST.unpack(message)
            if op == OP_STOP:
                return
            timing.arrived(scorer.sketches.last_read_s)
            after, overlap = (layer + 1) % channel.spec.layers, timing.overlap()
            try:
                scorer.answer(layer, op, then_prepare=after if overlap else None)
                status = STATUS_OK
            except Exception:  # reported to the host, which does this request itself
                traceback.print_exc(file=sys.stderr)
                status = STATUS_FAILED
            os.write(responses, RESPONSE.pack(request_id, status))
            timing.answered()
            if not overlap:
                scorer.sketches.prepare(after)
    finally:
        scorer.close()


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
