import pytest
import torch

from kvtier.engine.swap.device_checksum import block_checksums


def random_rows(blocks: int = 4, nbytes: int = 8192) -> torch.Tensor:
    return torch.randint(0, 256, (blocks, nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def test_equal_blocks_have_equal_checksums_and_each_row_is_its_own():
    rows = random_rows()
    sums = block_checksums(rows)
    assert sums.shape == (4, 2) and sums.dtype == torch.int64
    assert torch.equal(sums, block_checksums(rows.clone()))
    assert torch.equal(block_checksums(rows[2:3]), sums[2:3])
    assert len({tuple(row) for row in sums.tolist()}) == 4


@pytest.mark.parametrize("position", [0, 1, 4095, 8191])
def test_a_flipped_bit_anywhere_changes_the_checksum(position):
    rows = random_rows(blocks=1)
    damaged = rows.clone()
    damaged[0, position] ^= 0x10
    assert not torch.equal(block_checksums(rows), block_checksums(damaged))


def test_swapped_words_and_a_shifted_block_change_the_weighted_sum():
    rows = random_rows(blocks=1)
    swapped = rows.clone()
    swapped[0, 0:2], swapped[0, 100:102] = rows[0, 100:102].clone(), rows[0, 0:2].clone()
    shifted = torch.roll(rows, shifts=2, dims=1)  # same words, each one position later
    for other in (swapped, shifted):
        plain, weighted = block_checksums(other)[0]
        assert plain == block_checksums(rows)[0, 0]  # the plain sum cannot see a reordering...
        assert weighted != block_checksums(rows)[0, 1]  # ...the weighted one does


def test_the_largest_words_do_not_overflow():
    rows = torch.full((1, 1 << 20), 0xFF, dtype=torch.uint8)
    plain, weighted = block_checksums(rows)[0].tolist()
    words = torch.arange(1 << 19, dtype=torch.float64)
    assert plain == 0xFFFF * (1 << 19)
    assert weighted == int(0xFFFF * float(((words % 65521) + 1).sum()))


def test_odd_sizes_and_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="even bytes"):
        block_checksums(torch.zeros((2, 7), dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        block_checksums(torch.zeros((2, 8), dtype=torch.float32))
