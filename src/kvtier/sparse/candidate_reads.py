"""The lookahead's candidates, storage side: the best-scored cold slots read, checked and handed over.

For a candidates request (protocol.py) the scorer, once it has scored the
layer, takes each sequence's `counts[seq]` best-scored slots, reads their
full-precision K|V records (slot_reads.py: the run's own file, or a stored
image's where the slot was not rewritten), checks every page read against the
crcs the host recorded in the channel as it wrote the file (or the image's
persisted ones), and copies slots and records into the request's candidate
area. So the reads, their checks and the cutting out of records run beside
the data, on the scorer's core, and the host finds verified K/V in shared
memory. A page that fails its check fails the request: the host then reads
the candidates itself through the same code (scorer_client.py) and raises.
Imports no torch: it runs in the scorer process.
"""

from __future__ import annotations

import numpy as np

from kvtier.sparse.protocol import CONTROL_AREA, CONTROL_CANDIDATE_READ_BYTES, CONTROL_COLD_TOKENS, Channel
from kvtier.sparse.record_file import RecordFile
from kvtier.sparse.slot_reads import submit_slot_reads
from kvtier.sparse.top_share import top_share


class CandidateReader:
    """Fills the channel's candidate areas from the K|V file `own` (and a stored image's, `base`)."""

    def __init__(self, channel: Channel, own: RecordFile, base: RecordFile | None = None) -> None:
        self.channel, self.own, self.base = channel, own, base

    def read(self, layer: int) -> None:
        """Read and check the current request's candidates of `layer` into its area (its scores must be in)."""
        channel = self.channel
        area, cold_tokens = int(channel.control[CONTROL_AREA]), int(channel.control[CONTROL_COLD_TOKENS])
        scores = channel.results["score"]
        slots = [best(scores[seq, :cold_tokens], int(count)) for seq, count in enumerate(channel.counts)]
        read = submit_slot_reads(self.own, self.base, channel.overlay, layer, slots, list(range(len(slots))))()
        for seq, (chosen, (records, nbytes)) in enumerate(zip(slots, read)):
            channel.found_slots[area, seq, : len(chosen)] = chosen
            channel.found_records[area, seq, : len(chosen)] = records
            channel.found_bytes[area, seq] = nbytes
        channel.control[CONTROL_CANDIDATE_READ_BYTES] += int(channel.found_bytes[area].sum())


def best(scores: np.ndarray, count: int) -> np.ndarray:
    """Indices of the `count` highest scores, ascending (all of them when there are fewer)."""
    if count >= len(scores):
        return np.arange(len(scores))
    return top_share(scores[None], max(count, 0))[0]
