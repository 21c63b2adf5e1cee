"""Sketches in two files: a stored image's, checked per page and read in place, and the run's own (the overlay)."""

import numpy as np
import pytest

from kvtier.errors import ChecksumError
from kvtier.sparse.record_file import RecordFile, RecordLayout, open_for_reading
from kvtier.sparse.scorer.stored_sketches import StoredSketches
from kvtier.storage import PAGE, IOEngine, aligned_buffer
from kvtier.storage.checksum import PageChecksums

RECORD, SLOTS = 100, 500  # records across page boundaries


def records(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, RECORD), dtype=np.uint8)


@pytest.fixture()
def files(tmp_path):
    """A stored file of 300 records per region (with its page crcs) and an own file of another slot capacity."""
    with IOEngine(2) as io:
        stored = RecordFile(str(tmp_path / "stored"), RecordLayout(RECORD, 2, 1, 320), io, page_checksums=PageChecksums)
        own = RecordFile(str(tmp_path / "own"), RecordLayout(RECORD, 2, 1, SLOTS), io)
        for layer in range(2):
            stored.write_records(layer, 0, np.arange(300), records(layer, 300))
        (tmp_path / "stored.crc").write_bytes(stored.pages.to_bytes())
        sketches = StoredSketches({"path": stored.path, "layout": stored.layout.to_dict(),
                                   "pages_path": str(tmp_path / "stored.crc"), "page": stored.page})
        fd, _ = open_for_reading(own.path)
        yield io, sketches, own, fd
        sketches.close()
        stored.remove()
        own.remove()


def test_each_slot_is_read_where_its_bytes_are(files):
    io, sketches, own, fd = files
    overlay = np.zeros(360, dtype=np.uint8)
    rewritten = np.array([3, 41, 42, 299, *range(300, 360)])  # promotion swaps into stored slots, then demotions
    own.write_records(1, 0, rewritten, records(7, len(rewritten)))
    overlay[rewritten] = 1
    buffer = aligned_buffer(own.layout.region_stride)
    read = sketches.read_layered(io, fd, own.layout, 1, 0, overlay, buffer)
    expected = np.concatenate([records(1, 300), np.zeros((60, RECORD), dtype=np.uint8)])
    expected[rewritten] = records(7, len(rewritten))
    assert np.array_equal(buffer[: 360 * RECORD].reshape(360, RECORD), expected)
    assert read < 2 * sketches.layout.prefix_bytes(300)  # the own file: only the pages holding its slots


def test_a_damaged_stored_page_is_an_error_naming_the_file(files):
    io, sketches, own, fd = files
    with open(sketches.path, "r+b") as file:
        file.seek(sketches.layout.region_offset(1, 0) + PAGE + 5)
        byte = file.read(1)
        file.seek(-1, 1)
        file.write(bytes([byte[0] ^ 0x01]))
    buffer = aligned_buffer(own.layout.region_stride)
    sketches.read_layered(io, fd, own.layout, 0, 0, np.zeros(300, dtype=np.uint8), buffer)  # layer 0 is intact
    with pytest.raises(ChecksumError, match="stored.*layer 1: checksum mismatch in data page"):
        sketches.read_layered(io, fd, own.layout, 1, 0, np.zeros(300, dtype=np.uint8), buffer)
