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
a few KiB: docs/decisions.md). The bytes read are counted and reported.
"""

from __future__ import annotations

import numpy as np

from kvtier.storage.geometry import PAGE

BRIDGED_GAP_BYTES = 2048


def pages_holding(slots: np.ndarray, record_bytes: int, max_gap: int | None = None,
                  page: int = PAGE) -> np.ndarray:
    """Sorted numbers of the `page`-byte pages covering records `slots` (int64) of `record_bytes` each, gaps <=
    `max_gap` pages (default: BRIDGED_GAP_BYTES, at least one page) bridged."""
    max_gap = max(1, BRIDGED_GAP_BYTES // page) if max_gap is None else max_gap
    if not slots.size:
        return np.empty(0, dtype=np.int64)
    first_page = slots * record_bytes // page
    last_page = ((slots + 1) * record_bytes - 1) // page
    if record_bytes > page:  # a record spans pages in between as well
        pages = np.unique(ranges(first_page, last_page - first_page + 1))
    else:
        pages = np.unique(np.concatenate([first_page, last_page]))
    return bridge_gaps(pages, max_gap)


def bridge_gaps(pages: np.ndarray, max_gap: int) -> np.ndarray:
    """Sorted unique `pages` plus every gap of at most `max_gap` pages between two of them."""
    gaps = np.diff(pages) - 1
    small = np.flatnonzero((gaps > 0) & (gaps <= max_gap))
    if not small.size:
        return pages
    return np.sort(np.concatenate([pages, ranges(pages[small] + 1, gaps[small])]))


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """starts[0] .. starts[0] + counts[0] - 1, then the same for each next pair: one array, no Python loop."""
    ends = np.cumsum(counts)
    return np.arange(ends[-1]) + np.repeat(starts - ends + counts, counts)
