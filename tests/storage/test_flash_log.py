"""The append-only flash log against a model of live/stale slots, and against the naive reuse baseline."""

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.errors import ConfigError, StorageError
from kvtier.storage.flash_log import FlashFullError, FlashLog, NaiveReuseAllocator, SlotAllocator


def _is_ring_run(slots: list[int], num_slots: int) -> bool:
    return all(b == (a + 1) % num_slots for a, b in zip(slots, slots[1:]))


def _stale_slots(allocator) -> int:
    """Freed slots that cannot be written yet (always 0 for a policy that reuses at once)."""
    return allocator.num_slots - allocator.live - allocator.free_slots


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences; the model knows which slots are live, stale, or reclaimable."""

    allocator: SlotAllocator

    def start(self, allocator: SlotAllocator, segment_slots: int) -> None:
        self.allocator = allocator
        self.segment_slots = segment_slots
        self.live: set[int] = set()
        self.written: set[int] = set()
        # Stale slots whose whole segment has been free at some moment since they were freed.
        self.reclaimable: set[int] = set()

    def _segment(self, slot: int) -> range:
        start = slot - slot % self.segment_slots
        return range(start, min(start + self.segment_slots, self.allocator.num_slots))

    @rule(n=st.integers(min_value=0, max_value=40))
    def allocate(self, n):
        before = (self.allocator.free_slots, self.allocator.live, self.allocator.appends)
        if n > before[0]:
            with pytest.raises(FlashFullError):
                self.allocator.allocate(n)
            assert (self.allocator.free_slots, self.allocator.live, self.allocator.appends) == before
            return
        slots = self.allocator.allocate(n)
        assert len(slots) == len(set(slots)) == n
        assert all(0 <= slot < self.allocator.num_slots for slot in slots)
        assert not self.live & set(slots), "a live slot was handed out again"
        self.check_placement(slots)
        self.live |= set(slots)
        self.written |= set(slots)
        self.reclaimable -= set(slots)

    def check_placement(self, slots: list[int]) -> None:
        """Policy-specific promise about where the slots land."""

    @rule(data=st.data())
    def free(self, data):
        if not self.live:
            return
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, max_size=12))
        self.allocator.free(chosen)
        self.live -= set(chosen)
        for slot in chosen:
            segment = self._segment(slot)
            if not self.live.intersection(segment):
                self.reclaimable |= self.written.intersection(segment) - self.live

    @invariant()
    def counts_add_up(self):
        assert self.allocator.live == len(self.live)
        assert _stale_slots(self.allocator) >= 0
        assert all(self.allocator.is_live(slot) for slot in self.live)


class FlashLogMachine(AllocatorMachine):
    @initialize(num_slots=st.integers(min_value=1, max_value=48), data=st.data())
    def make(self, num_slots, data):
        segment_slots = data.draw(st.integers(min_value=1, max_value=num_slots))
        self.start(FlashLog(num_slots, segment_slots=segment_slots), segment_slots)

    def check_placement(self, slots):
        assert _is_ring_run(slots, self.allocator.num_slots)
        reused = set(slots) & self.written
        assert reused <= self.reclaimable, "a stale slot was reused before its segment was fully free"

    @invariant()
    def every_append_is_sequential(self):
        assert self.allocator.sequential_appends == self.allocator.appends


class NaiveMachine(AllocatorMachine):
    @initialize(num_slots=st.integers(min_value=1, max_value=48))
    def make(self, num_slots):
        self.start(NaiveReuseAllocator(num_slots), segment_slots=1)

    def check_placement(self, slots):
        free_before = set(range(self.allocator.num_slots)) - self.live
        assert slots == sorted(free_before)[: len(slots)], "naive must hand out the lowest free slots"

    @invariant()
    def nothing_is_stale(self):
        assert _stale_slots(self.allocator) == 0


TestFlashLogMachine = FlashLogMachine.TestCase
TestFlashLogMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
TestNaiveMachine = NaiveMachine.TestCase
TestNaiveMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


def test_head_waits_for_the_oldest_segment_to_empty():
    log = FlashLog(8, segment_slots=4)
    assert log.allocate(4) == [0, 1, 2, 3]
    assert log.allocate(4) == [4, 5, 6, 7]
    log.free([0, 1, 2])
    assert (log.free_slots, _stale_slots(log)) == (0, 3)
    with pytest.raises(FlashFullError, match="segment 0, which still holds 1 live blocks"):
        log.allocate(1)
    log.free([3])
    assert log.free_slots == 4
    assert log.allocate(2) == [0, 1]
    assert (log.reclaimed_segments, log.overwrites, log.appends, log.sequential_appends) == (1, 2, 3, 3)


def test_stale_slot_is_skipped_where_naive_reuses_it():
    log, naive = FlashLog(8, segment_slots=4), NaiveReuseAllocator(8)
    for allocator in (log, naive):
        allocator.allocate(4)
        allocator.free([1])
    assert log.allocate(1) == [4]
    assert naive.allocate(1) == [1]
    assert (log.overwrites, naive.overwrites) == (0, 1)
    assert (log.sequential_share, naive.sequential_share) == (1.0, 0.5)


def test_allocation_runs_across_the_ring_end():
    log = FlashLog(8, segment_slots=2)
    log.free(log.allocate(6))
    assert log.allocate(4) == [6, 7, 0, 1]
    assert log.reclaimed_segments == 1


def test_shorter_last_segment():
    log = FlashLog(10, segment_slots=4)
    assert log.num_segments == 3
    log.allocate(9)
    log.free(range(8))
    assert log.free_slots == 1 + 8  # slot 9, then segments 0 and 1; segment 2 holds slot 8
    log.free([8])
    assert log.allocate(9) == [9, *range(8)]  # slot 8 waits until the head re-enters segment 2


def test_single_segment_log_reopens_only_when_empty():
    log = FlashLog(4, segment_slots=4)
    log.allocate(4)
    log.free([0, 1, 2])
    assert log.free_slots == 0
    log.free([3])
    assert log.allocate(4) == [0, 1, 2, 3]


def test_full_error_is_a_storage_error_and_changes_nothing():
    log = FlashLog(4, segment_slots=2)
    log.allocate(3)
    with pytest.raises(StorageError, match="recompute"):
        log.allocate(2)
    assert (log.live, log.free_slots, log.appends) == (3, 1, 1)
    assert log.allocate(1) == [3]
    naive = NaiveReuseAllocator(4)
    naive.allocate(4)
    with pytest.raises(FlashFullError, match="1 blocks requested, 0 of 4"):
        naive.allocate(1)


@pytest.mark.parametrize("allocator", [FlashLog(4, segment_slots=2), NaiveReuseAllocator(4)])
def test_bad_free_raises_and_changes_nothing(allocator):
    allocator.allocate(2)
    for bad in ([0, 2], [0, 0], [7], [-1]):
        with pytest.raises(ValueError):
            allocator.free(bad)
        assert allocator.live == 2 and allocator.is_live(0)
    with pytest.raises(ValueError):
        allocator.allocate(-1)
    assert allocator.allocate(0) == []


@pytest.mark.parametrize(
    ("num_slots", "segment_slots"), [(0, 1), (4, 0), (4, 5), (4, 1.5), (True, 1)]
)
def test_bad_geometry_raises_config_error(num_slots, segment_slots):
    with pytest.raises(ConfigError):
        FlashLog(num_slots, segment_slots=segment_slots)


def _steady_swap_workload(allocator: SlotAllocator, seed: int, steps: int = 3000) -> int:
    """Keep the file about half full: victims of 1-8 blocks swap out, random ones swap back in.

    Returns how many swap-outs fell back to recompute (FlashFullError).
    """
    rng = random.Random(seed)
    swapped: list[list[int]] = []
    fallbacks = 0
    for _ in range(steps):
        if swapped and allocator.live >= allocator.num_slots // 2:
            allocator.free(swapped.pop(rng.randrange(len(swapped))))
            continue
        try:
            swapped.append(allocator.allocate(rng.randint(1, 8)))
        except FlashFullError:
            fallbacks += 1
            allocator.free(swapped.pop(rng.randrange(len(swapped))))
    return fallbacks


def test_steady_swap_workload_is_sequential_for_the_log_only():
    log, naive = FlashLog(256, segment_slots=16), NaiveReuseAllocator(256)
    _steady_swap_workload(log, seed=0)
    assert _steady_swap_workload(naive, seed=0) == 0
    assert log.appends > 1000 and naive.appends > 1000
    assert log.sequential_share == 1.0
    assert log.reclaimed_segments > 0
    assert naive.sequential_share < 0.3  # 0.118 with this seed


def test_fifo_swap_in_never_blocks_the_log():
    log = FlashLog(64, segment_slots=8)
    swapped: list[list[int]] = []
    for step in range(2000):
        n = 1 + step % 5
        while log.free_slots < n:
            log.free(swapped.pop(0))  # oldest victim resumes first
        swapped.append(log.allocate(n))
    assert log.sequential_share == 1.0
    assert log.reclaimed_segments > 100


def test_blocking_segment_names_the_oldest_live_segment_and_its_slots():
    log = FlashLog(32, segment_slots=8)
    first = log.allocate(8)
    log.allocate(20)
    assert log.head == 28
    assert log.blocking_segment() == 0
    assert list(log.segment_range(0)) == first
    log.free(first)
    assert log.blocking_segment() == 1  # the next one in ring order
    assert log.allocate(8) == [28, 29, 30, 31, 0, 1, 2, 3]
    log.free(list(range(8, 32)) + [0, 1, 2, 3])
    assert log.blocking_segment() is None


def test_resume_continues_a_persisted_log_where_it_stopped():
    before = FlashLog(32, segment_slots=8)
    kept = before.allocate(10)
    before.free(kept[:3])
    after = FlashLog(32, segment_slots=8)
    after.resume(live=kept[3:], written=kept, head=before.head)
    assert (after.live, after.free_slots, after.head) == (before.live, before.free_slots, before.head)
    assert after.allocate(4) == [10, 11, 12, 13]
    assert after.sequential_share == 1.0
    after.allocate(18)  # wraps to the stale slots 0-2 ...
    assert after.overwrites == 0
    after.free(kept[3:8])
    after.free(list(range(10, 16)))
    with pytest.raises(FlashFullError):
        after.allocate(12)  # ... but segment 1 still holds slots 8-9 written before the restart
    after.free(kept[8:])
    after.allocate(1)
    assert after.overwrites == 1  # slot 0 was written by the process before


@pytest.mark.parametrize("live, head", [([40], 0), ([1], 32), ([], -1)])
def test_resume_refuses_slots_outside_the_log(live, head):
    with pytest.raises(ValueError, match="outside"):
        FlashLog(32, segment_slots=8).resume(live=live, written=live, head=head)


def test_resume_refuses_a_log_in_use():
    log = FlashLog(32, segment_slots=8)
    log.allocate(1)
    with pytest.raises(ValueError, match="fresh log"):
        log.resume(live=[], written=[], head=0)
