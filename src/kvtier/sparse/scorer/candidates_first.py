"""The scorer's disk serves the candidate reads first; the next layer's sketch read fills the gaps.

The host waits for a candidates request's K/V reads (candidate_reads.py); nobody
waits yet for the next layer's sketches, read ahead on a thread of their own
(sketch_scorer.py). On one disk the two slow each other down, so the read ahead
goes one sequence's sketches at a time, and each waits until no candidate read
is in flight. Imports no torch: it runs in the scorer process.
"""

from __future__ import annotations

import threading


class CandidatesFirst:
    """Counts the candidate reads in flight; lets the sketch read ahead wait until there are none."""

    def __init__(self) -> None:
        self._in_flight = 0
        self._quiet = threading.Condition()

    def begin(self) -> None:
        """A batch of candidate reads is about to be queued."""
        with self._quiet:
            self._in_flight += 1

    def end(self) -> None:
        """That batch has landed (or failed)."""
        with self._quiet:
            self._in_flight -= 1
            if not self._in_flight:
                self._quiet.notify_all()

    def wait_quiet(self) -> None:
        """Return once no candidate read is in flight."""
        with self._quiet:
            self._quiet.wait_for(lambda: self._in_flight == 0)
