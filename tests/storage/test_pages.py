import numpy as np

from kvtier.storage.geometry import PAGE, SECTOR
from kvtier.storage.pages import page_runs, pages_holding, ranges


def test_only_short_gaps_are_bridged():
    slots = np.array([0, 2, 5, 6, 9])  # one page per record: pages 0, 2, 5, 6, 9
    np.testing.assert_array_equal(pages_holding(slots, PAGE, max_gap=1), [0, 1, 2, 5, 6, 9])  # 3-4, 7-8: two pages
    np.testing.assert_array_equal(pages_holding(slots, PAGE, max_gap=2), np.arange(10))
    np.testing.assert_array_equal(pages_holding(slots, PAGE, max_gap=0), slots)


def test_runs_are_the_first_page_and_count_of_each_stretch_of_adjacent_pages():
    first, counts = page_runs(np.array([9, 0, 2, 5, 6]), PAGE, max_gap=1)  # unsorted slots are sorted first
    np.testing.assert_array_equal(first, [0, 5, 9])
    np.testing.assert_array_equal(counts, [3, 2, 1])


def test_a_record_straddling_a_page_boundary_needs_both_pages():
    # 768-byte records: record 5 is bytes 3840-4607 (pages 0 and 1), record 16 bytes 12288-13055 (page 3 only)
    np.testing.assert_array_equal(pages_holding(np.array([16, 5]), 768, max_gap=0), [0, 1, 3])
    np.testing.assert_array_equal(pages_holding(np.array([16, 5]), 768), [0, 1, 2, 3])  # page 2 bridged


def test_records_larger_than_a_page_cover_every_page_in_between():
    np.testing.assert_array_equal(pages_holding(np.array([1]), 3 * PAGE, max_gap=0), [3, 4, 5])


def test_no_records_no_pages():
    assert pages_holding(np.empty(0, dtype=np.int64), 768).size == 0


def test_ranges_concatenates_runs():
    np.testing.assert_array_equal(ranges(np.array([5, 0, 20]), np.array([2, 3, 1])), [5, 6, 0, 1, 2, 20])


def test_sector_pages_hold_sector_sized_records_exactly():
    # 1536-byte records fill three sectors each: record 5 is sectors 15-17, nothing around it
    sectors = [15, 16, 17, 21, 22, 23]
    np.testing.assert_array_equal(pages_holding(np.array([5, 7]), 1536, max_gap=0, page=SECTOR), sectors)
    np.testing.assert_array_equal(pages_holding(np.array([5, 7]), 1536, page=SECTOR), np.arange(15, 24))  # 4 KiB
    np.testing.assert_array_equal(pages_holding(np.array([5, 9]), 1536, page=SECTOR), [15, 16, 17, 27, 28, 29])
    np.testing.assert_array_equal(pages_holding(np.array([5, 6]), 1024, page=SECTOR), [10, 11, 12, 13])


def test_many_scattered_records_give_the_pages_a_per_record_loop_gives():
    slots = np.random.default_rng(1).choice(20_000, 900, replace=False)
    for record_bytes, page in ((1536, PAGE), (6000, PAGE), (1536, SECTOR), (1000, SECTOR)):
        expected = set()
        for slot in slots.tolist():
            expected.update(range(slot * record_bytes // page, ((slot + 1) * record_bytes - 1) // page + 1))
        np.testing.assert_array_equal(pages_holding(slots, record_bytes, max_gap=0, page=page), sorted(expected))
        bridged = sorted(expected)
        bridged += [page for before, after in zip(bridged, bridged[1:]) if after - before <= 3  # gaps of <= 2 pages
                    for page in range(before + 1, after)]
        np.testing.assert_array_equal(pages_holding(slots, record_bytes, max_gap=2, page=page), sorted(bridged))
