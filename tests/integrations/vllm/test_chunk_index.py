"""Replaying journal records into the index: newest wins, reclaims drop, the head follows allocation order."""

from kvtier.integrations.vllm.chunk_index import ChunkIndex, Entry
from kvtier.integrations.vllm.journal import Journal, head, put, reclaim


def replay(tmp_path, records, num_slots, name="j"):
    """Records written to a journal, read back and replayed, as a restart does."""
    journal = Journal(tmp_path / name, bytes(16))
    journal.append(records)
    journal.close()
    reopened = Journal(tmp_path / name, bytes(16))
    reopened.close()  # its records stay: they were read at open
    return ChunkIndex.replay(reopened.records, num_slots)


def test_replay_applies_puts_reclaims_and_finds_the_head(tmp_path):
    records = [put(0, 0, 10, b"a"), put(1, 1, 11, b"b"), put(2, 2, 12, b"c"),
               reclaim(3, 0, 2), put(5, 1, 15, b"e"), put(4, 0, 14, b"d")]  # the later job finished first
    replayed = replay(tmp_path, records, num_slots=8)
    index = replayed.index
    assert {key: index.get(key) for key in (b"a", b"b", b"c", b"d", b"e")} == {
        b"a": None, b"b": None, b"c": Entry(2, 12, 2), b"d": Entry(0, 14, 4), b"e": Entry(1, 15, 5)}
    assert replayed.head == 2 and replayed.next_seq == 6 and replayed.written == [0, 1, 2]


def test_a_compacted_journal_says_the_same(tmp_path):
    index = ChunkIndex(8)
    index.add(b"x", Entry(6, 1, 3))
    index.add(b"y", Entry(7, 2, 4))
    index.add(b"x", Entry(0, 3, 9))  # stored again elsewhere: the old slot is forgotten
    replayed = replay(tmp_path, index.records(at=1, seq=10), num_slots=8)
    assert sorted(replayed.index.slots()) == sorted(index.slots()) == [0, 7]
    assert replayed.index.get(b"x") == Entry(0, 3, 9)
    assert replayed.head == 1 and replayed.next_seq == 11


def test_the_head_wraps_after_the_last_slot(tmp_path):
    assert replay(tmp_path, [put(0, 7, 0, b"k")], num_slots=8, name="a").head == 0
    assert replay(tmp_path, [put(0, 7, 0, b"k"), head(1, 5)], num_slots=8, name="b").head == 5


def test_a_key_stored_again_keeps_only_its_last_slot(tmp_path):
    replayed = replay(tmp_path, [put(0, 0, 1, b"k"), put(1, 1, 2, b"k")], num_slots=4)
    assert replayed.index.slots() == [1] and replayed.index.get(b"k") == Entry(1, 2, 1)

