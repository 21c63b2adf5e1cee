"""The storage-side scorer: a separate OS process that owns the cold pool's reads beside the data.

It plays the SmartSSD's FPGA (the HillInfer paper's HIE + CEC): per request it reads
one layer's key sketches next to the data, computes raw inner products with
the query found in shared memory, and streams `<position, score>` blocks back.
It never sends keys to the host. For the lookahead's candidates requests it
also reads the best-scored tokens' full-precision K/V and checks them
(candidate_reads.py), so those reads leave the host's critical path too.

Started by `ScorerClient` as `python -m kvtier.sparse.scorer.process CONFIG`,
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
(`PrepareTiming`), yielding the disk to candidate reads in flight
(candidates_first.py). Behind, it also scores the next request while the one
before waits for its candidate reads (`Answers`). On start it answers request
id 0 (ready). It exits when the request pipe closes (the host is gone) or on
a stop request.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.sparse.scorer.candidate_reads import CandidateReader
from kvtier.sparse.scorer.candidates_first import CandidatesFirst
from kvtier.sparse.protocol import (
    AREAS, OP_CANDIDATES, OP_STOP, RESPONSE, STATUS_FAILED, STATUS_OK, Channel, ChannelSpec, Request, read_exact,
)
from kvtier.sparse.record_file import RecordFile, RecordLayout, open_for_reading, stored_pages
from kvtier.sparse.cold.sketch import SketchFormat
from kvtier.sparse.scorer.sketch_scorer import SketchScorer
from kvtier.sparse.scorer.stored_sketches import StoredSketches
from kvtier.storage import IOEngine
from kvtier.storage.checksum import PageChecksums


class StorageScorer:
    """What the scorer does for a request: score the layer's sketches and, for a candidates request, read the best
    candidates' K/V (candidate_reads.py). The host's fallback builds the same from the same config."""

    def __init__(self, config: dict, channel: Channel, memory_budget: int, crash_after_blocks: int) -> None:
        self.io = IOEngine(config["io_threads"])
        prefetch_io = IOEngine(config["io_threads"])
        self._engines, self._files = [self.io, prefetch_io], []
        first = CandidatesFirst()  # the disk serves what the host waits for before the next layer's sketches
        self.fd, self.sketches, self.candidates = -1, None, []
        try:
            self.fd, _ = open_for_reading(config["sketch_path"])
            self.sketches = SketchScorer(
                self.fd, RecordLayout(**config["layout"]), SketchFormat(**config["format"]), channel,
                config["aggregation"], config["block_tokens"], self.io, memory_budget=memory_budget,
                crash_after_blocks=crash_after_blocks,
                stored=StoredSketches(config["stored"]) if config.get("stored") else None, prefetch_io=prefetch_io,
                first=first)
            if channel.spec.candidates:
                self.candidates = [self._candidate_reader(config, channel, area, first) for area in range(AREAS)]
        except BaseException:
            self.close()
            raise

    def _candidate_reader(self, config: dict, channel: Channel, area: int, first: CandidatesFirst) -> CandidateReader:
        """An area's reader, with engines of its own: one batch in flight per engine at a time."""
        kv, stored = config["kv"], config.get("stored_kv")
        layout = RecordLayout(**kv["layout"])
        pages = channel.kv_checksums(layout.file_bytes // kv["page"], kv["page"])
        own = self._file(kv["path"], layout, pages, config["io_threads"])
        base = None
        if stored:
            base = self._file(stored["path"], RecordLayout(**stored["layout"]), stored_pages(stored),
                              config["io_threads"])
        return CandidateReader(channel, area, own, base, first)

    def _file(self, path: str, layout: RecordLayout, pages: PageChecksums, io_threads: int) -> RecordFile:
        self._engines.append(IOEngine(io_threads))
        self._files.append(RecordFile(path, layout, self._engines[-1], stored_pages=pages))
        return self._files[-1]

    def start(self, request: Request, resume: bool = False, then_prepare: int | None = None) -> Callable[[], None]:
        """Score `request`'s layer and queue a candidates request's reads; the returned call finishes it (waits for
        the reads and checks them). With `resume`, skip the score blocks already reported; with `then_prepare`,
        read that layer's sketches meanwhile."""
        self.sketches.score_layer(request.layer, request.area, request.cold_tokens, resume=resume,
                                  then_prepare=then_prepare)
        if request.op == OP_CANDIDATES:
            return self.candidates[request.area].submit(request.layer, request.cold_tokens)
        return _done

    def answer(self, request: Request, resume: bool = False) -> None:
        """Do `request` to the end (the host's fallback)."""
        self.start(request, resume=resume)()

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


def _done() -> None:
    """A request with nothing left to finish once scored."""


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

    def arrived(self, read_s: float, busy: bool = False) -> None:
        """A request came; `read_s`: how long the last sketch read took; `busy`: the one before is not answered yet
        (no time at all was left for the read)."""
        if busy:
            slack = -read_s
        elif self._answered is not None:
            slack = self.clock() - self._answered - read_s
        else:
            return
        self.slack_s += self.WEIGHT * (slack - self.slack_s)


@dataclass
class Started:
    """A request scored whose answer is still to be sent: `finish` (None if it failed) waits for its reads."""

    request: Request
    finish: Callable[[], None] | None

    @classmethod
    def of(cls, scorer: StorageScorer, request: Request, then_prepare: int | None) -> Started:
        try:
            return cls(request, scorer.start(request, then_prepare=then_prepare))
        except Exception:  # reported to the host, which does this request itself
            traceback.print_exc(file=sys.stderr)
            return cls(request, None)

    def status(self) -> int:
        if self.finish is None:
            return STATUS_FAILED
        try:
            self.finish()
            return STATUS_OK
        except Exception:  # reported to the host, which does this request itself
            traceback.print_exc(file=sys.stderr)
            return STATUS_FAILED


class Answers:
    """Finishes started requests and answers them, in order, on a thread of its own: while one waits for its
    candidate reads, the main thread can score the next."""

    def __init__(self, responses: int, timing: PrepareTiming) -> None:
        self.responses, self.timing = responses, timing
        self._queue: queue.SimpleQueue[Started | None] = queue.SimpleQueue()
        self._unanswered = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._answer_all, name="kvtier-scorer-answers", daemon=True)
        self._thread.start()

    def put(self, started: Started) -> None:
        with self._idle:
            self._unanswered += 1
        self._queue.put(started)

    def busy(self) -> bool:
        """Whether a request is not answered yet."""
        return self._unanswered > 0

    def wait_idle(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._unanswered == 0)

    def close(self) -> None:
        """Finish what was started (its reads land before the files close), then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _answer_all(self) -> None:
        while (started := self._queue.get()) is not None:
            status = started.status()
            try:
                os.write(self.responses, RESPONSE.pack(started.request.id, status))
            except BrokenPipeError:
                pass  # the host is gone; the main thread sees the end of its requests
            self.timing.answered()
            with self._idle:
                self._unanswered -= 1
                self._idle.notify_all()


def serve(config: dict) -> None:
    """Answer requests in order. Once the scorer falls behind the host (`PrepareTiming`), a request that comes while
    the one before waits for its candidate reads is scored meanwhile: at batch 8 the scorer's own time per layer
    paces the step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the host stops this one
    if config.get("core") is not None:  # before its I/O threads start: they inherit it (kvtier.sparse.threads.scorer_core)
        os.sched_setaffinity(0, {config["core"]})
    channel = Channel(ChannelSpec(**config["channel"]), config["channel_fd"])
    requests, responses = config["request_fd"], config["response_fd"]
    scorer = StorageScorer(config, channel, config["memory_budget"], config.get("crash_after_blocks", -1))
    timing = PrepareTiming()
    answers = Answers(responses, timing)
    try:
        os.write(responses, RESPONSE.pack(0, STATUS_OK))
        while True:
            message = read_exact(requests, Request.FORMAT.size)
            request = Request.unpack(message) if message else None
            if request is None or request.op == OP_STOP:
                return
            timing.arrived(scorer.sketches.last_read_s, busy=answers.busy())
            after, overlap = (request.layer + 1) % channel.spec.layers, timing.overlap()
            answers.put(Started.of(scorer, request, then_prepare=after if overlap else None))
            if not overlap:  # the next layer's sketches are read once this one is answered, the disk then free
                answers.wait_idle()
                scorer.sketches.prepare(after)
    finally:
        answers.close()
        scorer.close()


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
