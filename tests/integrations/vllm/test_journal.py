"""The index journal: records survive a reopen, a torn or corrupt tail is cut off, rewrites are atomic."""

from __future__ import annotations

import os

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.journal import RECORD_BYTES, Journal, head, put, reclaim
from kvtier.storage.file_lock import FileInUseError

FILE_ID = bytes(range(16))


def seqs_after_reopen(path, file_id=FILE_ID) -> list[int]:
    """The records' sequence numbers a reopened journal replays (closed again: it holds the journal's lock)."""
    journal = Journal(path, file_id)
    journal.close()
    return [record.seq for record in journal.records]


def test_appended_records_come_back_in_order(tmp_path):
    journal = Journal(tmp_path / "j", FILE_ID)
    records = [put(0, 0, 0xDEADBEEF, b"\x00" * 36), put(1, 1, 7, b"k" * 64), reclaim(2, 0, 4), head(3, 9)]
    journal.append(records[:2])
    journal.append(records[2:])
    journal.close()
    again = Journal(tmp_path / "j", FILE_ID)
    assert list(again.records) == records and again.count == 4 and again.dropped_bytes == 0


def test_a_corrupt_record_ends_the_replay_and_the_rest_is_cut_off(tmp_path):
    path = tmp_path / "j"
    journal = Journal(path, FILE_ID)
    journal.append([put(seq, seq, seq, b"key%d" % seq) for seq in range(5)])
    journal.close()
    with open(path, "r+b") as file:
        file.seek(RECORD_BYTES * 3 + 50)  # inside the third record
        file.write(b"X")
    again = Journal(path, FILE_ID)
    assert [record.seq for record in again.records] == [0, 1]
    assert again.dropped_bytes == 3 * RECORD_BYTES
    assert path.stat().st_size == 3 * RECORD_BYTES
    again.append([put(9, 9, 9, b"new")])
    again.close()
    assert seqs_after_reopen(path) == [0, 1, 9]


def test_a_journal_of_another_flash_file_starts_empty(tmp_path):
    journal = Journal(tmp_path / "j", FILE_ID)
    journal.append([put(0, 0, 0, b"k")])
    journal.close()
    other = Journal(tmp_path / "j", bytes(16))
    assert len(other.records) == 0 and os.path.getsize(tmp_path / "j") == RECORD_BYTES


def test_rewrite_replaces_the_journal_whole(tmp_path):
    journal = Journal(tmp_path / "j", FILE_ID, fsync=True)
    journal.append([put(seq, seq, 0, b"k%d" % seq) for seq in range(10)])
    journal.rewrite([put(8, 8, 0, b"k8"), head(10, 9)])
    journal.append([put(11, 9, 0, b"k11")])
    journal.close()
    assert seqs_after_reopen(tmp_path / "j") == [8, 10, 11]
    assert sorted(os.listdir(tmp_path)) == ["j"]


def test_a_second_opener_is_refused_and_cuts_nothing_off(tmp_path):
    journal = Journal(tmp_path / "j", FILE_ID)
    journal.append([put(0, 0, 0, b"k")])
    with pytest.raises(FileInUseError, match=f"index journal {tmp_path / 'j'} is in use by kvtier process {os.getpid()}"):
        Journal(tmp_path / "j", bytes(16))  # another file id: it would have emptied the journal
    journal.close()
    assert seqs_after_reopen(tmp_path / "j") == [0]


def test_a_key_longer_than_a_record_is_refused():
    with pytest.raises(ConfigError, match="longer than the 64 bytes"):
        put(0, 0, 0, b"k" * 65).encode()
