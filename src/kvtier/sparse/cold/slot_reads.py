"""Reading cold slots' K|V records where their bytes lie: the run's own file, or a stored image's.

A run that reuses a stored sparse image (cold_image.py) holds some cold slots
still in the image's read-only file and the slots it has written since in its
own (the channel's `overlay` mask: 1 where the own file holds the slot). The
host's fetches (cold_pool.py) and the storage scorer's candidate reads
(candidate_reads.py) both go through here, so both read and check the same
pages the same way. Imports no torch: it runs in the scorer process too.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvtier.sparse.record_file import RecordFile

Records = list[tuple[np.ndarray, int]]  # per sequence: records uint8 [n, record_bytes] in the order asked, bytes read


def submit_slot_reads(own: RecordFile, base: RecordFile | None, overlay: np.ndarray, layer: int,
                      slots_by_seq: list[np.ndarray], seqs: list[int]) -> Callable[[], Records]:
    """Queue the reads of each sequence's `slots` of `layer`, every run of every sequence in flight at once, each slot
    read from `own` where `overlay` [layers, batch, slots] is 1 and from `base` where it is 0 (when there is a base).
    Returns the wait, which checks every page read against its file's crcs and cuts out the records."""
    if base is None:
        return own.submit_many(layer, list(zip(seqs, slots_by_seq))).result
    mine = [overlay[layer, seq, slots].astype(bool) for seq, slots in zip(seqs, slots_by_seq)]
    own_reads = own.submit_many(layer, [(seq, slots[held]) for seq, slots, held in zip(seqs, slots_by_seq, mine)])
    base_reads = base.submit_many(layer, [(seq, slots[~held]) for seq, slots, held in zip(seqs, slots_by_seq, mine)])

    def result() -> Records:
        merged = []
        for slots, held, (own_records, own_bytes), (base_records, base_bytes) in zip(
                slots_by_seq, mine, own_reads.result(), base_reads.result()):
            records = np.empty((len(slots), own.layout.record_bytes), dtype=np.uint8)
            records[held], records[~held] = own_records, base_records
            merged.append((records, own_bytes + base_bytes))
        return merged

    return result
