"""Key sketches that lie in two files: a stored image's (read-only, checked per page) and the run's own.

A run that reuses a stored sparse image (cold_image.py) scores cold slots whose
sketches are still the image's, read in place, and slots it has written since
(demotions, promotion swaps: the channel's `overlay` mask), read from its own
file. A region's prefix is read from the image in one large read and every
page of it is checked against the image's persisted crcs; the pages of the own
file holding overlay slots are read next and their records copied over.
Imports no torch: it runs in the scorer process.
"""

from __future__ import annotations

import os

import numpy as np

from kvtier.errors import ChecksumError
from kvtier.sparse.record_file import PagePlan, RecordLayout, open_for_reading, stored_pages
from kvtier.storage import PAGE, IOEngine, aligned_buffer, round_up


class StoredSketches:
    """The stored image's sketch file, read-only, with the crc of every page it holds."""

    def __init__(self, config: dict) -> None:
        self.path = config["path"]
        self.layout = RecordLayout(**config["layout"])
        self.pages = stored_pages(config)
        self.fd, _ = open_for_reading(self.path)

    def read_layered(self, io: IOEngine, own_fd: int, own_layout: RecordLayout, layer: int, seq: int,
                     overlay: np.ndarray, buffer: np.ndarray) -> int:
        """The first len(overlay) sketches of (layer, seq) into `buffer` (page-aligned): the image's where `overlay`
        is 0, the own file's where it is 1; the bytes read. Raises ChecksumError when an image page fails."""
        stored = np.flatnonzero(overlay == 0)
        count = int(stored[-1]) + 1 if len(stored) else 0
        nbytes = self.layout.prefix_bytes(count)
        if nbytes:
            io.read_runs(self.fd, [(self.layout.region_offset(layer, seq), [memoryview(buffer[:nbytes])])])
            # the pages holding the records: an image keeps no crc of a 4 KiB page's sectors past its last record
            held = round_up(count * self.layout.record_bytes, self.pages.page)
            problem = self.pages.mismatch(self.layout.region_offset(layer, seq), buffer[:held])
            if problem is not None:
                raise ChecksumError(f"{self.path}: stored sketches of layer {layer}: {problem}; the KV store entry "
                                    "is damaged")
        own = np.flatnonzero(overlay)
        return nbytes + (_patch_own(io, own_fd, own_layout, layer, seq, own, buffer) if len(own) else 0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _patch_own(io: IOEngine, fd: int, layout: RecordLayout, layer: int, seq: int, slots: np.ndarray,
               buffer: np.ndarray) -> int:
    """Read the own file's pages holding `slots` and copy those records into `buffer`; the bytes read."""
    plan = PagePlan(slots, layout.record_bytes, PAGE)  # whole pages: any filesystem takes them
    scratch = aligned_buffer(len(plan.pages) * PAGE)
    offsets, lengths, starts = plan.runs(layout.region_offset(layer, seq), 0)
    io.read_runs(fd, [(offset, [memoryview(scratch[start : start + length])])
                      for offset, length, start in zip(offsets.tolist(), lengths.tolist(), starts.tolist())])
    records = buffer[: (int(slots[-1]) + 1) * layout.record_bytes].reshape(-1, layout.record_bytes)
    records[slots] = plan.gather(scratch, 0)
    return len(plan.pages) * PAGE
