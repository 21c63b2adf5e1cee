"""Replaying journal records into the index: newest wins, reclaims drop, the head follows allocation order."""

from kvtier.integrations.vllm.chunk_index import ChunkIndex, Entry
from kvtier.integrations.vllm.journal import head, put, reclaim


def test_replay_applies_puts_reclaims_and_finds_the_head():
    records = [put(0, 0, 10, b"a"), put(1, 1, 11, b"b"), put(2, 2, 12, b"c"),
               reclaim(3, 0, 2), put(5, 1, 15, b"e"), put(4, 0, 14, b"d")]  # the later job finished first
    replayed = ChunkIndex.replay(records, num_slots=8)
    index = replayed.index
    assert {key: index.get(key) for key in (b"a", b"b", b"c", b"d", b"e")} == {
        b"a": None, b"b": None, b"c": Entry(2, 12, 2), b"d": Entry(0, 14, 4), b"e": Entry(1, 15, 5)}
    assert replayed.head == 2 and replayed.next_seq == 6 and replayed.written == {0, 1, 2}


def test_a_compacted_journal_says_the_same():
    index = ChunkIndex()
    index.add(b"x", Entry(6, 1, 3))
    index.add(b"y", Entry(7, 2, 4))
    index.add(b"x", Entry(0, 3, 9))  # stored again elsewhere: the old slot is forgotten
    replayed = ChunkIndex.replay(index.records(at=1, seq=10), num_slots=8)
    assert replayed.index.slots() == index.slots() == [7, 0]
    assert replayed.head == 1 and replayed.next_seq == 11


def test_the_head_wraps_after_the_last_slot():
    assert ChunkIndex.replay([put(0, 7, 0, b"k")], num_slots=8).head == 0
    assert ChunkIndex.replay([head(0, 5)], num_slots=8).head == 5
