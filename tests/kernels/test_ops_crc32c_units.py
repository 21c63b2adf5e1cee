import crc32c
import numpy as np
import pytest

from kvtier.kernels import ops


@pytest.mark.parametrize("unit", [4096, 1536, 512, 12, 5, 1])
@pytest.mark.parametrize("count", [0, 1, 2, 3, 4, 7])
def test_each_unit_crc_equals_the_crc32c_package(unit, count):
    data = np.random.default_rng(unit * 10 + count).integers(0, 256, unit * count, dtype=np.uint8)
    found = ops.crc32c_units(data, unit=unit)
    assert found.dtype == np.uint32
    assert found.tolist() == [crc32c.crc32c(data[i * unit : (i + 1) * unit].tobytes()) for i in range(count)]


def test_check_value_of_the_standard():
    assert ops.crc32c_units(b"123456789", unit=9)[0] == 0xE3069283


def test_one_flipped_bit_changes_only_its_unit():
    data = np.zeros(5 * 4096, dtype=np.uint8)
    before = ops.crc32c_units(data, unit=4096)
    data[3 * 4096 + 17] ^= 0x10
    after = ops.crc32c_units(data, unit=4096)
    assert (before != after).tolist() == [False, False, False, True, False]


@pytest.mark.parametrize("unit", [0, -1, 4096])
def test_a_buffer_that_is_not_whole_units_is_refused(unit):
    with pytest.raises(ValueError, match="^data: .*not a whole number of"):
        ops.crc32c_units(bytes(100), unit=unit)


def test_a_strided_buffer_is_refused():
    with pytest.raises(ValueError, match="^data: not C-contiguous$"):
        ops.crc32c_units(np.zeros((4, 8), dtype=np.uint8)[:, :4], unit=4)
