"""Which pages hold some of a region's fixed-size records (tokens) packed back to back from a page boundary.

Used by every reader that fetches chosen tokens rather than whole regions: the
sparse path's cold pool (one K|V record per token) and the selective baselines
(token rows of K or V blocks). O_DIRECT moves whole read units, so a token costs
the pages it touches; a page here is the file's read unit (a 512-byte sector
where the device takes them, else 4 KiB: direct_file.direct_read_unit).

A short gap of unwanted bytes between two wanted pages is read too, so the
two reads become one: one 4 KiB page (on the development VM's disk a fetch of
285 random records from each of 30 layers took a median 1.73 s instead of
2.30 s, 8 interleaved trials, for 14% more pages), or up to 2 KiB of sectors
(BRIDGED_GAP_BYTES; chosen tokens cluster, and a read's fixed cost outweighs
a few KiB). The bytes read are counted and reported.
"""

from __future__ import annotations

import numpy as np

from kvtier.storage.geometry import PAGE

BRIDGED_GAP_BYTES = 2048


def page_runs(slots: np.ndarray, record_bytes: int, max_gap: int | None = None,
              page: int = PAGE) -> tuple[np.ndarray, np.ndarray]:
    """(first page, page count) of each run of adjacent `page`-byte pages covering records `slots` (int64) of
    `record_bytes` each, ascending, gaps <= `max_gap` pages (default: BRIDGED_GAP_BYTES, at least one page) bridged.

    One pass over the records' page spans (a running maximum), not a set of pages: this runs once per layer and
    decode step for the cold fetch, where sorting and de-duplicating every page cost several times more.
    """
    max_gap = max(1, BRIDGED_GAP_BYTES // page) if max_gap is None else max_gap
    if not slots.size:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    if (slots[1:] < slots[:-1]).any():
        slots = np.sort(slots)
    first = slots * record_bytes // page
    reach = np.maximum.accumulate(((slots + 1) * record_bytes - 1) // page)  # last page needed so far
    opens = np.empty(len(first), dtype=bool)  # a record opens a run when the gap before it is too long to bridge
    opens[0] = True
    np.greater(first[1:], reach[:-1] + (max_gap + 1), out=opens[1:])
    starts = np.flatnonzero(opens)
    ends = np.empty_like(starts)
    ends[:-1], ends[-1] = starts[1:] - 1, len(first) - 1
    return first[starts], reach[ends] - first[starts] + 1


def pages_holding(slots: np.ndarray, record_bytes: int, max_gap: int | None = None,
                  page: int = PAGE) -> np.ndarray:
    """Sorted numbers of the pages of `page_runs`."""
    return ranges(*page_runs(slots, record_bytes, max_gap, page))


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """starts[0] .. starts[0] + counts[0] - 1, then the same for each next pair: one array, no Python loop."""
    if not counts.size:
        return np.empty(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.arange(ends[-1]) + np.repeat(starts - ends + counts, counts)
