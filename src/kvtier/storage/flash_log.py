"""Slot allocators for the flash cache file: HiFC's append-only log and the naive reuse baseline.

The flash cache file is created once and cut into fixed-size slots; one slot holds one KV block
(all layers' K and V of T tokens). These classes only decide *which* slots a swap-out writes;
they do no I/O.

`FlashLog` is HiFC's flash-aware block management: blocks are written at the head of a circular
log in physical order, and a freed slot turns *stale* instead of going back on a free list. The
log is cut into segments of `segment_slots` slots; the head enters a segment only when every slot
in it is free, like a log-structured file system's cleaner that never copies. The SSD therefore
sees one long sequential write stream that overwrites whole regions at a time, which is what kept
HiFC's write amplification at 1.02. When the segment ahead of the head still holds a live block
the log cannot advance: `allocate` raises `FlashFullError` and the caller recomputes the sequence
instead of swapping it out.

`NaiveReuseAllocator` is the paper's "left-append" baseline (vLLM's free list): it always hands out
the lowest free slots, so after a few hundred swap-outs the writes land all over the file.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Iterable

from kvtier.errors import ConfigError, StorageError

# A reclaimed segment should cover whole NAND erase blocks (tens of MiB) so the drive can erase
# instead of garbage-collecting; KV blocks are a few MiB, so 16 of them already do.
DEFAULT_SEGMENT_SLOTS = 16


class FlashFullError(StorageError):
    """No slots can be written now: the caller should recompute instead of swapping out."""


def _require_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"flash cache: {name} must be a positive integer, got {value!r}")
    return value


class SlotAllocator(ABC):
    """Bookkeeping shared by both policies: which slots are live, and how the writes were placed.

    Stats (plain counters, for benchmarks):
        appends: allocations made (calls to `allocate` with n > 0).
        sequential_appends: allocations whose first slot follows the previous allocation's last
            slot (slot 0 follows the last slot: the file is used as a ring).
        overwrites: slots written that had been written before (a proxy for write amplification).
        reclaimed_segments: segments the log re-entered after all their blocks were freed.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = _require_positive_int("number of slots", num_slots)
        self._live = bytearray(num_slots)
        self._written = bytearray(num_slots)
        self._live_count = 0
        self._expected_start = 0
        self.appends = 0
        self.sequential_appends = 0
        self.overwrites = 0
        self.reclaimed_segments = 0

    @property
    def live(self) -> int:
        """Slots holding a block that has not been freed."""
        return self._live_count

    @property
    @abstractmethod
    def free_slots(self) -> int:
        """Slots `allocate` can hand out right now: allocate(free_slots) succeeds, one more fails."""

    @property
    def sequential_share(self) -> float:
        """Fraction of allocations that continued where the previous one ended (1.0 before any)."""
        return self.sequential_appends / self.appends if self.appends else 1.0

    def is_live(self, slot: int) -> bool:
        return bool(self._live[slot])

    def allocate(self, n: int) -> list[int]:
        """Reserve `n` slots for blocks about to be written; all or nothing.

        Raises:
            FlashFullError: fewer than `n` slots can be written now; nothing was reserved.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"number of slots to allocate must be a non-negative integer, got {n!r}")
        if n == 0:
            return []
        if n > self.free_slots:
            raise FlashFullError(self._full_message(n))
        slots = self._take(n)
        self._record_writes(slots)
        return slots

    def free(self, slots: Iterable[int]) -> None:
        """Release slots whose blocks were swapped back in or dropped; all or nothing."""
        slots = list(slots)
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots freed twice in one call: {sorted(slots)}")
        for slot in slots:
            if not 0 <= slot < self.num_slots or not self._live[slot]:
                raise ValueError(f"slot {slot} is not live in this flash cache (double free or foreign slot)")
        for slot in slots:
            self._live[slot] = 0
        self._live_count -= len(slots)
        self._release(slots)

    def _record_writes(self, slots: list[int]) -> None:
        self.appends += 1
        if slots[0] == self._expected_start:
            self.sequential_appends += 1
        self._expected_start = (slots[-1] + 1) % self.num_slots
        for slot in slots:
            self.overwrites += self._written[slot]
            self._written[slot] = 1
            self._live[slot] = 1
        self._live_count += len(slots)

    def _full_message(self, n: int) -> str:
        return (
            f"flash cache full: {n} blocks requested, {self.free_slots} of {self.num_slots} slots writable now; "
            "swap blocks back in or recompute this sequence instead of swapping it out"
        )

    @abstractmethod
    def _take(self, n: int) -> list[int]:
        """Pick `n` slots (the caller checked that n <= free_slots) and update the policy's state."""

    @abstractmethod
    def _release(self, slots: list[int]) -> None:
        """Update the policy's state for `slots`, which are no longer live."""


class FlashLog(SlotAllocator):
    """HiFC's append-only log: physical-order writes, stale slots reused only per whole segment."""

    def __init__(self, num_slots: int, segment_slots: int = DEFAULT_SEGMENT_SLOTS) -> None:
        super().__init__(num_slots)
        _require_positive_int("segment size in slots", segment_slots)
        if segment_slots > num_slots:
            raise ConfigError(
                f"flash cache: segment of {segment_slots} slots is larger than the {num_slots}-slot file; "
                "use a smaller segment or a larger file"
            )
        self.segment_slots = segment_slots
        self.num_segments = -(-num_slots // segment_slots)  # the last segment may be shorter
        self._segment_live = [0] * self.num_segments
        self._head = 0  # next slot to write

    @property
    def free_slots(self) -> int:
        return self._writable_run()[0]

    def _full_message(self, n: int) -> str:
        blocker = self._writable_run()[1]
        if blocker is None:
            return super()._full_message(n)
        return (
            f"{super()._full_message(n)} (the log head waits for segment {blocker}, "
            f"which still holds {self._segment_live[blocker]} live blocks)"
        )

    @property
    def head(self) -> int:
        """The slot the next allocation starts at."""
        return self._head

    def blocking_segment(self) -> int | None:
        """The segment whose live blocks stop the head from advancing further (None: nothing does).

        A cache that may drop blocks frees this segment's live slots to make room (oldest first).
        """
        return self._writable_run()[1]

    def segment_range(self, segment: int) -> range:
        """The slots of `segment`."""
        return range(segment * self.segment_slots, self._segment_end(segment))

    def resume(self, live: Iterable[int], written: Iterable[int], head: int) -> None:
        """Continue a log persisted by an earlier process: `live` slots hold blocks, `written` ones were
        written at some time, the next allocation starts at `head`. Only on a log that allocated nothing."""
        if self.appends or self._live_count:
            raise ValueError("resume() needs a fresh log: this one has allocated already")
        live, written = sorted(set(live)), set(written)
        if not 0 <= head < self.num_slots or any(not 0 <= slot < self.num_slots for slot in (*live, *written)):
            raise ValueError(f"resume(): a slot or the head ({head}) lies outside this {self.num_slots}-slot log")
        for slot in written.union(live):
            self._written[slot] = 1
        for slot in live:
            self._live[slot] = 1
            self._segment_live[self._segment_of(slot)] += 1
        self._live_count = len(live)
        self._head = self._expected_start = head

    def _writable_run(self) -> tuple[int, int | None]:
        """Slots writable from the head on, and the segment that stops the run (None: nothing does).

        The run is the room left in the open segment, then every following segment that is
        entirely free, in ring order, up to the first one that still holds a live block.
        """
        at_boundary = self._head % self.segment_slots == 0
        open_segment = self._segment_of(self._head)
        room = 0 if at_boundary else self._segment_end(open_segment) - self._head
        first = open_segment if at_boundary else open_segment + 1
        for step in range(self.num_segments if at_boundary else self.num_segments - 1):
            segment = (first + step) % self.num_segments
            if self._segment_live[segment]:
                return room, segment
            room += self._segment_end(segment) - segment * self.segment_slots
        return room, None

    def _take(self, n: int) -> list[int]:
        slots: list[int] = []
        while len(slots) < n:
            segment = self._segment_of(self._head)
            if self._head % self.segment_slots == 0 and self._written[self._head]:
                self.reclaimed_segments += 1
            count = min(n - len(slots), self._segment_end(segment) - self._head)
            slots.extend(range(self._head, self._head + count))
            self._segment_live[segment] += count
            self._head = (self._head + count) % self.num_slots
        return slots

    def _release(self, slots: list[int]) -> None:
        for slot in slots:
            self._segment_live[self._segment_of(slot)] -= 1

    def _segment_of(self, slot: int) -> int:
        return slot // self.segment_slots

    def _segment_end(self, segment: int) -> int:
        return min((segment + 1) * self.segment_slots, self.num_slots)


class NaiveReuseAllocator(SlotAllocator):
    """The "left-append" baseline: always reuse the lowest free slots, like vLLM's free list."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self._free = list(range(num_slots))  # sorted, hence already a heap

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def _take(self, n: int) -> list[int]:
        return [heapq.heappop(self._free) for _ in range(n)]

    def _release(self, slots: list[int]) -> None:
        for slot in slots:
            heapq.heappush(self._free, slot)
