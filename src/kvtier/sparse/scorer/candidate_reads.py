"""The lookahead's candidates, storage side: the best-scored cold slots read, checked and handed over.

For a candidates request (protocol.py) the scorer, once it has scored the
layer, takes each sequence's `counts[seq]` best-scored slots and queues the
reads of their full-precision K|V records (slot_reads.py: the run's own file,
or a stored image's where the slot was not rewritten); while the disk works it
may score the next request. Once the reads land it checks every page against
the crcs the host recorded in the channel as it wrote the file (or the
image's persisted ones) and copies slots and records into the request's area.
So the reads, their checks and the cutting out of records run beside the
data, on the scorer's core, and the host finds verified K/V in shared
memory. A page that fails its check fails the request: the host then reads
the candidates itself through the same code (scorer_client.py) and raises.
While the reads are in flight the next layer's sketch read waits
(candidates_first.py): the host waits for these, not for that.
Imports no torch: it runs in the scorer process.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvtier.sparse.scorer.candidates_first import CandidatesFirst
from kvtier.sparse.protocol import CONTROL_CANDIDATE_READ_BYTES, Channel
from kvtier.sparse.record_file import RecordFile
from kvtier.sparse.cold.slot_reads import submit_slot_reads
from kvtier.kernels import ops


class CandidateReader:
    """Fills one request area's candidates from the K|V file `own` (and a stored image's, `base`). Each area has its
    own reader, files and I/O engines, so one area's reads may be in flight while the others' are queued. `first`: the
    scorer's count of candidate reads in flight, which its sketch read ahead yields to."""

    def __init__(self, channel: Channel, area: int, own: RecordFile, base: RecordFile | None = None,
                 first: CandidatesFirst | None = None) -> None:
        self.channel, self.area, self.own, self.base = channel, area, own, base
        self.first = first or CandidatesFirst()

    def submit(self, layer: int, cold_tokens: int) -> Callable[[], None]:
        """Queue the reads of the area's request's best candidates of `layer` (its scores must be in); the returned
        call waits for them, checks them and puts them into the area."""
        channel, area = self.channel, self.area
        scores = channel.results["score"][area]
        slots = [best(scores[seq, :cold_tokens], int(count)) for seq, count in enumerate(channel.counts[area])]
        self.first.begin()
        try:
            wait = submit_slot_reads(self.own, self.base, channel.overlay, layer, slots, list(range(len(slots))))
        except BaseException:
            self.first.end()
            raise

        def fill() -> None:
            try:
                landed = wait()
            finally:
                self.first.end()
            for seq, (chosen, (records, nbytes)) in enumerate(zip(slots, landed)):
                channel.found_slots[area, seq, : len(chosen)] = chosen
                channel.found_records[area, seq, : len(chosen)] = records
                channel.found_bytes[area, seq] = nbytes
            channel.control[CONTROL_CANDIDATE_READ_BYTES] += int(channel.found_bytes[area].sum())

        return fill


def best(scores: np.ndarray, count: int) -> np.ndarray:
    """Indices of the `count` highest scores, ascending (all of them when there are fewer)."""
    if count >= len(scores):
        return np.arange(len(scores))
    return ops.top_share(scores[None], count=max(count, 0))[0]
