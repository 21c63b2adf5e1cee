"""Host side of the storage scorer: start it, send per-layer requests, survive its death.

The client is the host's one seam to the cold tier's scorer: it owns every
read and write of the shared channel. `request(layer, query, cold_tokens)`
returns at once so the host scores its hot pool while the scorer works;
`scores()` blocks until the layer's cold scores are in and returns them.
With `counts` the request is a candidates request (the lookahead's):
`candidates()` then returns each sequence's best-scored slots and their
verified K/V records, read by the scorer (candidate_reads.py). Up to AREAS
requests (protocol.py) may be unanswered at once; answers are taken oldest
first.
Fault handling:

- The scorer dies: its end of the response pipe closes, so waiting for its
  answer sees end of file at once (a request written after its death gets
  EPIPE). Detection costs no timeout and happens within the step that needed
  the scores.
- The scorer hangs: the wait gives up after `response_timeout_s`, kills it,
  and treats it as dead.
- The scorer reports a failure (an exception it printed to stderr).

In each case the host does the rest of the request itself with the very same
code (scorer_process.StorageScorer), resuming after the last score block the
scorer finished, so the scores, the candidates (and the generated text) are
identical to a run without the fault; a candidates page that fails its check
fails there too, with the error. Then it starts a fresh scorer, at most
`max_restarts` times, and sends it the requests still unanswered; after
that it keeps scoring on the host.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.errors import StorageError
from kvtier.sparse.protocol import (
    AREAS, OP_CANDIDATES, OP_SCORE, OP_STOP, RESPONSE, STATUS_OK, Channel, Request, read_exact,
)
from kvtier.sparse.record_file import RecordLayout
from kvtier.sparse.scorer.process import StorageScorer
from kvtier.sparse.cold.sketch import SketchFormat
from kvtier.sparse.threads import scorer_core

log = logging.getLogger(__name__)
START_TIMEOUT_S = 60.0


@dataclass
class Pending:
    """A request not answered yet, and whether the running scorer was sent it."""

    request: Request
    sent: bool


class ScorerClient:
    """One storage-scorer process serving the cold pool of one cache."""

    def __init__(self, channel: Channel, sketch_path: str, layout: RecordLayout, fmt: SketchFormat, aggregation: str,
                 block_tokens: int, io_threads: int = 2, memory_budget: int = 0, max_restarts: int = 3,
                 response_timeout_s: float = 60.0, crash_after_blocks: int = -1, kv: dict | None = None,
                 stored: dict | None = None, stored_kv: dict | None = None) -> None:
        """`kv`: the run's K|V file (path, layout, page), which candidates requests read (the channel must have room
        for candidates). `stored`, `stored_kv`: a stored image's sketches and K|V records (ColdImage.scorer_config),
        read in place where not rewritten."""
        self.channel = channel
        self.config = {
            "channel": channel.spec.to_dict(), "channel_fd": channel.fd, "sketch_path": sketch_path,
            "layout": layout.to_dict(), "format": {"bits": fmt.bits, "heads": fmt.heads, "head_dim": fmt.head_dim,
                                                   "group": fmt.group},
            "aggregation": aggregation, "block_tokens": block_tokens, "io_threads": io_threads,
            "memory_budget": memory_budget, "crash_after_blocks": crash_after_blocks, "kv": kv, "stored": stored,
            "stored_kv": stored_kv,
        }
        self.max_restarts = max_restarts
        self.response_timeout_s = response_timeout_s
        self.restarts = 0
        self.host_scored_requests = 0  # requests (partly) scored on the host after a fault
        self.process: subprocess.Popen | None = None
        self._request_fd = self._response_fd = -1
        self._request_id = 0
        self._pending: deque[Pending] = deque()  # requests not answered yet, oldest first
        self._answered: Request | None = None  # the request answered last
        self._fallback: StorageScorer | None = None
        self._start()

    # ----- per-layer requests -----

    def request(self, layer: int, query: np.ndarray, cold_tokens: int, counts: np.ndarray | None = None) -> None:
        """Ask for `layer`'s cold scores (`cold_tokens` per sequence) for `query` [batch, heads, q_per_head, head_dim];
        with `counts` (per sequence, at most the channel's `candidates`), for its best candidates' K/V too. Up to AREAS
        requests may be unanswered (the scorer answers in order); the answer AREAS requests back must have been used
        up, since this one reuses its area."""
        if len(self._pending) == AREAS:
            raise RuntimeError(f"{AREAS} requests unanswered: take an answer before the next request")
        if counts is not None and int(counts.max(initial=0)) > self.channel.spec.candidates:
            raise ValueError(f"{int(counts.max())} candidates asked, the channel has room for "
                             f"{self.channel.spec.candidates}")
        self._request_id += 1
        area = self._request_id % AREAS  # in turn: the last requests' answers may still be in use
        self.channel.query[area] = query
        self.channel.progress[area] = 0
        if counts is not None:
            self.channel.counts[area] = counts
        request = Request(self._request_id, layer, OP_SCORE if counts is None else OP_CANDIDATES, cold_tokens, area)
        self._pending.append(Pending(request, sent=False))
        self._send(self._pending[-1])

    def _send(self, pending: Pending) -> None:
        if self.process is None:
            return
        try:
            os.write(self._request_fd, pending.request.pack())
            pending.sent = True
        except BrokenPipeError:
            pass  # died since the last request: waiting for the answer recovers (_answer)

    def scores(self) -> np.ndarray:
        """The oldest request's cold scores, float32 [batch, cold_tokens] (a copy); blocks until all are in."""
        request = self._answer()
        return self.channel.results["score"][request.area, :, : request.cold_tokens].copy()

    def candidates(self) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """The oldest request's answer (a candidates request): per sequence its candidates' slots (ascending); their
        verified K|V records, uint8 [batch, width, record_bytes], sequence s's the first len(slots[s]); the bytes read
        per sequence. Blocks until they are in. Views of the shared segment, valid until AREAS requests after it."""
        request = self._answer()
        area, channel = request.area, self.channel
        counts = channel.counts[area].tolist()
        slots = [channel.found_slots[area, seq, :count] for seq, count in enumerate(counts)]
        return slots, channel.found_records[area, :, : max(counts)], channel.found_bytes[area].copy()

    def answered_scores(self) -> np.ndarray:
        """The sketch scores of the request answered last (a candidates request's too), float32 [batch,
        cold_tokens] (a copy); to be taken before AREAS more requests."""
        request = self._answered
        if request is None:
            raise RuntimeError("no request answered yet")
        return self.channel.results["score"][request.area, :, : request.cold_tokens].copy()

    def _answer(self) -> Request:
        """Wait for the oldest request's answer; do what the scorer did not, on the host."""
        if not self._pending:
            raise RuntimeError("no request to wait for")
        pending = self._pending.popleft()
        if not (pending.sent and self._response(pending.request.id) == STATUS_OK):
            self._recover(pending.request)
        self._answered = pending.request
        return pending.request

    def round_trip_s(self, repeats: int = 200, pause_s: float = 0.005) -> float:
        """Median seconds of an empty request (no cold tokens): the protocol's fixed cost per layer.

        After each answer the scorer prepares the next layer, which the host's work hides in decode;
        `pause_s` before each request lets it finish, so the figure is the round trip alone.
        """
        if self._pending:
            raise RuntimeError(f"{len(self._pending)} requests unanswered: a round trip must wait for its own answer")
        times = []
        query = np.zeros(self.channel.query.shape[1:], dtype=np.float32)
        for _ in range(repeats):
            time.sleep(pause_s)
            started = time.perf_counter()
            self.request(0, query, 0)
            self.scores()
            times.append(time.perf_counter() - started)
        return sorted(times)[len(times) // 2]

    def _response(self, request_id: int) -> int | None:
        """The status for request `request_id`, or None when the scorer is dead or hung."""
        while True:
            ready, _, _ = select.select([self._response_fd], [], [], self.response_timeout_s)
            if not ready:
                log.warning("storage scorer (pid %d) did not answer in %.0f s; killing it",
                            self.process.pid, self.response_timeout_s)
                self.process.kill()
                return None
            message = read_exact(self._response_fd, RESPONSE.size)
            if not message:
                return None
            answered, status = RESPONSE.unpack(message)
            if answered == request_id:
                return status

    # ----- faults -----

    def _recover(self, request: Request) -> None:
        """Do what the scorer did not, on the host, then replace the scorer."""
        self.host_scored_requests += 1
        if self.process is not None:
            code = self.process.poll()
            log.warning("storage scorer (pid %d) failed%s; scoring layer %d on the host",
                        self.process.pid, "" if code is None else f" (exit code {code})", request.layer)
        if self._fallback is None:
            self._fallback = StorageScorer(self.config, self.channel, memory_budget=0, crash_after_blocks=-1)
        self._fallback.answer(request, resume=True)
        self._replace()

    def _replace(self) -> None:
        """A fresh scorer (or none, past `max_restarts`), sent the requests the failed one left unanswered."""
        self._stop_process()
        self.process = self._restarted()
        for pending in self._pending:  # without a scorer, _answer does them on the host
            pending.sent = False
            self._send(pending)

    def _restarted(self) -> subprocess.Popen | None:
        if self.restarts >= self.max_restarts:
            if self.process is not None:
                log.warning("storage scorer restarted %d times; the host scores the cold pool from now on",
                            self.restarts)
            return None
        self.restarts += 1
        self.config["crash_after_blocks"] = -1  # injected faults happen once
        try:
            self._start()
        except StorageError as error:  # the generation goes on; only the first start must succeed
            log.warning("%s; the host scores the cold pool from now on", error)
            self.max_restarts = self.restarts  # one that cannot start now will not start at the next layer
            return None
        return self.process

    # ----- process lifetime -----

    def _start(self) -> None:
        request_read, self._request_fd = os.pipe()
        self._response_fd, response_write = os.pipe()
        config = dict(self.config, request_fd=request_read, response_fd=response_write, core=scorer_core())
        source_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [source_root, os.environ.get("PYTHONPATH")])))
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvtier.sparse.scorer.process", json.dumps(config)],
                pass_fds=(self.channel.fd, request_read, response_write), env=env,
            )
        finally:
            os.close(request_read)
            os.close(response_write)
        ready, _, _ = select.select([self._response_fd], [], [], START_TIMEOUT_S)
        if not ready or not read_exact(self._response_fd, RESPONSE.size):
            self._stop_process()
            raise StorageError(f"the storage scorer process did not start (see its error above); "
                               f"check that {self.config['sketch_path']} is readable")

    def _stop_process(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                try:
                    os.write(self._request_fd, Request(0, 0, OP_STOP).pack())
                except BrokenPipeError:
                    pass  # already exiting
                try:
                    self.process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
        for fd in (self._request_fd, self._response_fd):
            if fd >= 0:
                os.close(fd)
        self._request_fd = self._response_fd = -1

    def close(self) -> None:
        """Stop the scorer and release the fallback's resources."""
        self._stop_process()
        self.process = None
        if self._fallback is not None:
            self._fallback.close()
            self._fallback = None
