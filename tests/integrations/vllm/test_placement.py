"""Physical placement through FIEMAP: consecutive writes of one file follow each other on the device."""

import os

from kvtier.integrations.vllm.placement import file_extents, physical_range, physical_sequential_share


def test_writes_in_file_order_are_physically_sequential_and_reversed_ones_are_not(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    extents = file_extents(path)
    assert extents[0][0] == 0 and sum(length for _, _, length in extents) >= 1 << 20
    forward = [(path, index * 65536, 65536) for index in range(16)]
    # each extent boundary breaks at most the two adjacencies around the write it splits
    assert physical_sequential_share(forward) >= (15 - 2 * (len(extents) - 1)) / 15
    assert physical_sequential_share(forward[::-1]) == 0.0
    assert physical_sequential_share(forward[:1]) is None


def test_a_range_is_placed_only_inside_one_extent():
    assert physical_range([(0, 4096, 8192)], 4096, 4096) == (8192, 12288)
    assert physical_range([(0, 4096, 8192)], 4096, 8192) is None
