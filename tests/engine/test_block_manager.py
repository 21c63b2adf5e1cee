import pytest

from kvtier.errors import ConfigError
from kvtier.engine.block_manager import BlockManager, blocks_for
from kvtier.engine.sequence import SamplingParams, Sequence


def make_seq(tokens: int) -> Sequence:
    return Sequence(0, list(range(tokens)), SamplingParams(4))


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 64)] == [0, 1, 1, 2, 4]


def test_grow_extends_the_table_only_by_missing_blocks():
    manager = BlockManager(8, 16)
    seq = make_seq(20)
    manager.grow(seq, 20)
    assert seq.block_table == [0, 1]
    assert manager.blocks_needed(seq, 32) == 0
    assert manager.blocks_needed(seq, 33) == 1
    manager.grow(seq, 33)
    assert seq.block_table == [0, 1, 2]
    assert manager.num_free == 5


def test_release_returns_blocks_for_reuse():
    manager = BlockManager(4, 16)
    seq = make_seq(64)
    manager.grow(seq, 64)
    assert manager.num_free == 0
    manager.release(seq)
    assert seq.block_table == [] and manager.num_free == 4
    assert sorted(manager.allocate(4)) == [0, 1, 2, 3]


def test_overdraft_is_a_bug_not_a_silent_partial_grant():
    manager = BlockManager(2, 16)
    with pytest.raises(RuntimeError):
        manager.grow(make_seq(48), 48)
    assert manager.num_free == 2


def test_empty_pool_is_refused():
    with pytest.raises(ConfigError):
        BlockManager(0, 16)
