import numpy as np
import pytest

from kvtier.storage.checksum import ENTRY, ChecksumTable, PageChecksums, checksum
from kvtier.storage.geometry import PAGE, SECTOR


def test_checksum_matches_crc32c_reference_values():
    assert checksum(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert checksum(b"") == 0


def test_checksum_of_array_equals_checksum_of_its_bytes():
    array = np.arange(1000, dtype=np.float32)
    assert checksum(array) == checksum(array.tobytes())
    assert checksum(array) != checksum(array[::-1].copy())


def test_table_size_is_whole_pages():
    assert ChecksumTable.nbytes_for(1) == PAGE
    assert ChecksumTable.nbytes_for(PAGE // ENTRY.itemsize) == PAGE
    assert ChecksumTable.nbytes_for(PAGE // ENTRY.itemsize + 1) == 2 * PAGE


def test_table_records_and_reports_pages():
    slots_per_page = PAGE // ENTRY.itemsize
    table = ChecksumTable(3 * slots_per_page)
    assert table.stored_crc(5) is None
    assert table.record(5, 0xDEADBEEF) == 0
    assert table.record(slots_per_page + 1, 7) == 1
    assert table.stored_crc(5) == 0xDEADBEEF
    assert table.stored_crc(slots_per_page + 1) == 7
    assert table.stored_crc(6) is None
    page = np.frombuffer(table.pages(1, 1), dtype=ENTRY)
    assert (int(page[1]["crc"]), int(page[1]["written"])) == (7, 1)


def test_table_pages_are_aligned():
    table = ChecksumTable(2000)
    view = np.frombuffer(table.pages(1, 2), dtype=np.uint8)
    assert view.ctypes.data % PAGE == 0 and view.nbytes == 2 * PAGE
    with pytest.raises(IndexError):
        table.stored_crc(2000 * 100)


@pytest.mark.parametrize("page", [SECTOR, PAGE])
def test_page_checksums_name_the_first_bad_or_unwritten_page(page):
    data = np.random.default_rng(0).integers(0, 256, 4 * page, dtype=np.uint8)
    pages = PageChecksums(10, page)
    pages.record(2, pages.of(data[: 3 * page]))  # pages 2, 3, 4 written
    assert pages.mismatch_at(np.array([2, 3, 4]), data[: 3 * page]) is None
    assert pages.mismatch_at(np.array([2, 5]), data[: 2 * page]) == \
        f"data page 5 ({page} bytes at {5 * page}) was never written"
    assert pages.mismatch_at(np.array([2, 5]), data[: 2 * page], unwritten_ok=True) is None
    damaged = data[: 3 * page].copy()
    damaged[page + 9] ^= 1
    assert pages.mismatch_at(np.array([2, 3, 4]), damaged).startswith(
        f"checksum mismatch in data page 3 ({page} bytes at {3 * page}) (stored 0x")
    assert pages.mismatch(3 * page, damaged[page : 2 * page]).startswith("checksum mismatch in data page 3")


def test_page_checksums_of_sectors_cover_what_pages_cover():
    data = np.random.default_rng(1).integers(0, 256, 2 * PAGE, dtype=np.uint8)
    sectors = PageChecksums(2 * PAGE // SECTOR, SECTOR)
    sectors.record_data(0, data)
    assert sectors.mismatch(0, data) is None
    assert sectors.mismatch(PAGE + SECTOR, data[PAGE + SECTOR : PAGE + 2 * SECTOR]) is None
    damaged = data.copy()
    damaged[PAGE + SECTOR + 1] ^= 1
    assert sectors.mismatch(0, damaged) == sectors.mismatch(PAGE, damaged[PAGE:])  # the same sector named
    assert f"data page {PAGE // SECTOR + 1} " in sectors.mismatch(0, damaged)


def test_page_checksums_outlive_their_writer_and_a_damaged_table_is_refused():
    data = np.arange(3 * PAGE, dtype=np.uint8)
    written = PageChecksums(8)
    written.record(2, written.of(data))
    kept = PageChecksums(8)
    kept.copy(2, written, 2, 2)  # the third page left out: never written as far as the copy knows
    kept.copy(6, written, 3, 1)  # a page copied elsewhere keeps its crc
    loaded = PageChecksums.from_bytes(kept.to_bytes(), 8 * PAGE, PAGE)
    assert loaded.page == PAGE
    assert loaded.mismatch(2 * PAGE, data[: 2 * PAGE]) is None and loaded.mismatch(6 * PAGE, data[PAGE : 2 * PAGE]) is None
    assert "never written" in loaded.mismatch(4 * PAGE, data[2 * PAGE :])
    damaged = bytearray(kept.to_bytes())
    damaged[3] ^= 0x01
    for table in (bytes(damaged), kept.to_bytes()[:-1]):
        with pytest.raises(ValueError, match="damaged"):
            PageChecksums.from_bytes(table, 8 * PAGE, PAGE)
    with pytest.raises(ValueError, match="damaged"):  # a table of 4 KiB pages read as one of sectors
        PageChecksums.from_bytes(kept.to_bytes(), 8 * PAGE, SECTOR)
