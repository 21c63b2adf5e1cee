"""DocumentStore: longest-prefix lookup, LRU bound, crash-safe publishing (kill -9 at every write), concurrency."""

import errno
import logging
import os

import pytest
import torch

from kvtier.errors import ConfigError, StorageError
from kvtier.storage import IOEngine, direct_file
from kvtier.docstore import DocumentStore
from kvtier.docstore import entry as entry_module
from kvtier.docstore import document_store
from kvtier.docstore.entry import EntryWriter, read_layers
from store_entries import BLOCK, KilledAt, block_names, new_meta, prefill_updates


def publish(store: DocumentStore, keys: list[str], tokens: int, seed: int = 0, digest: str = "digest",
            document: str = "document", nbytes: int = 0):
    """An entry of `tokens` tokens of random K/V under `keys` (room made for `nbytes`); its id and the K/V written."""
    updates, whole = prefill_updates(tokens, 50, seed=seed)
    meta = new_meta(keys)
    meta.identity_digest, meta.document = digest, document
    writer = EntryWriter(store.room_for(nbytes), meta)
    for layer, keys_, values in updates:
        writer.add(layer, keys_, values)
    return store.publish(writer), whole


keys_for = block_names


def test_the_longest_stored_prefix_wins_and_the_limit_holds(store):
    publish(store, keys_for("a", 2), 2 * BLOCK)
    publish(store, keys_for("a", 5), 5 * BLOCK, seed=1)
    prompt = keys_for("a", 6)
    match = store.longest_prefix("digest", prompt, "document", limit=6)
    assert match.blocks == 5 and match.tokens == 5 * BLOCK
    assert store.longest_prefix("digest", prompt, "document", limit=3).blocks == 3
    assert store.longest_prefix("digest", keys_for("b", 5), "document", limit=5) is None


def test_another_identity_is_ignored_with_one_message(store, caplog):
    publish(store, keys_for("a", 2), 2 * BLOCK, digest="another model")
    with caplog.at_level(logging.WARNING):
        assert store.longest_prefix("digest", keys_for("a", 2), "document", limit=2) is None
        assert store.longest_prefix("digest", keys_for("a", 2), "document", limit=2) is None
    assert caplog.text.count("holds this document for another model") == 1


def test_another_identitys_entry_is_not_mentioned_when_the_prompt_reuses_its_own(store, caplog):
    publish(store, keys_for("x", 2), 2 * BLOCK, digest="another model")  # block keys include the identity
    publish(store, keys_for("a", 2), 2 * BLOCK, seed=1)
    with caplog.at_level(logging.WARNING):
        assert store.longest_prefix("digest", keys_for("a", 3), "document", limit=3).blocks == 2
    assert "another model" not in caplog.text


def test_least_recently_used_entries_are_evicted_to_stay_under_the_limit(tmp_path):
    store = DocumentStore(tmp_path / "store")
    first, _ = publish(store, keys_for("a", 2), 2 * BLOCK)
    size = store.entries()[0].nbytes  # on disk: its K/V and meta.json
    store = DocumentStore(tmp_path / "store", size_limit=2 * size)
    second, _ = publish(store, keys_for("b", 2), 2 * BLOCK, nbytes=size)
    os.utime(tmp_path / "store" / first / "meta.json", (1, 1))  # the first is older
    third, _ = publish(store, keys_for("c", 2), 2 * BLOCK, nbytes=size)
    assert {entry.id for entry in store.entries()} == {second, third}
    assert sum(entry.nbytes for entry in store.entries()) <= 2 * size


def test_a_prompt_larger_than_the_store_is_not_stored(tmp_path, caplog):
    store = DocumentStore(tmp_path / "store", size_limit="1MiB")
    with caplog.at_level(logging.WARNING):
        assert store.room_for(2 << 20) is None
    assert "larger than the KV store's limit" in caplog.text


def test_two_publishers_of_one_prefix_leave_one_intact_entry(store):
    first, whole = publish(store, keys_for("a", 3), 3 * BLOCK)
    second, _ = publish(store, keys_for("a", 3), 3 * BLOCK, seed=5)
    assert first == second and [entry.id for entry in store.entries()] == [first]
    assert not [path for path in store.root.iterdir() if path.name.startswith(".")]
    _assert_reads_back(store, whole)


def test_a_document_stored_meanwhile_by_another_question_is_not_stored_twice(store):
    document = keys_for("a", 4)
    first = EntryWriter(store.room_for(0), new_meta(document + keys_for("q", 1)))  # two questions, one new document
    second = EntryWriter(store.room_for(0), new_meta(document + keys_for("r", 1)))
    for writer, seed in ((first, 0), (second, 1)):
        for layer, keys, values in prefill_updates(5 * BLOCK, 50, seed=seed)[0]:
            writer.add(layer, keys, values)
    stored = store.publish(first)
    assert store.publish(second) == stored
    assert [entry.id for entry in store.entries()] == [stored]
    assert not [path for path in store.root.iterdir() if path.name.startswith(".")]  # the second copy is gone


def test_a_mostly_different_prompt_is_still_stored_beside_an_entry_sharing_its_start(store):
    first, _ = publish(store, keys_for("a", 1) + keys_for("b", 2), 3 * BLOCK)
    second, _ = publish(store, keys_for("a", 1) + keys_for("c", 2), 3 * BLOCK, seed=1)
    assert first != second and {entry.id for entry in store.entries()} == {first, second}


def test_two_processes_read_one_entry_at_once(store):
    torch.set_num_threads(1)  # the forked readers must not need the parent's thread pool
    _, whole = publish(store, keys_for("a", 3), 3 * BLOCK)
    readers = []
    for _ in range(2):
        child = os.fork()
        if child == 0:
            try:
                _assert_reads_back(store, whole)
            except BaseException:
                os._exit(1)
            os._exit(0)
        readers.append(child)
    assert [os.waitpid(child, 0)[1] for child in readers] == [0, 0]


def test_remove_and_clear_report_the_bytes_they_freed(store):
    first, _ = publish(store, keys_for("a", 1), BLOCK)
    publish(store, keys_for("b", 1), BLOCK)
    with pytest.raises(ConfigError, match="no KV store entry"):
        store.remove("zzz")
    sizes = {entry.id: entry.nbytes for entry in store.entries()}
    assert store.remove(first[:6]) == (first, sizes[first]) and sizes[first] > 0
    (second,) = set(sizes) - {first}
    assert store.clear() == (1, sizes[second]) and store.entries() == []


def test_an_entry_that_cannot_be_removed_is_an_error_naming_it(store, monkeypatch):
    entry_id, _ = publish(store, keys_for("a", 1), BLOCK)

    def read_only(*_):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(document_store.os, "rename", read_only)
    for attempt in (lambda: store.remove(entry_id), store.clear):
        with pytest.raises(StorageError, match=f"cannot remove KV store entry {entry_id} from {store.root}: "
                                               "Read-only file system"):
            attempt()
    monkeypatch.undo()
    assert [entry.id for entry in store.entries()] == [entry_id]


def test_a_writer_killed_at_any_point_leaves_a_whole_entry_or_none(tmp_path):
    torch.set_num_threads(1)  # the forked writer must not need the parent's thread pool
    visible = []
    for point in range(1, 42):  # every open, write, fsync, close and rename of publishing 3 blocks (40), and past them
        root = tmp_path / f"store-{point}"
        DocumentStore(root)
        child = os.fork()
        if child == 0:
            entry_module.os = document_store.os = direct_file.os = KilledAt(point)
            publish(DocumentStore(root), keys_for("a", 3), 3 * BLOCK)
            os._exit(0)
        _, status = os.waitpid(child, 0)
        store = DocumentStore(root)  # removes what the dead writer left
        assert not [path for path in root.iterdir() if path.name.startswith(".")]
        entries = store.entries()
        assert len(entries) <= 1
        if entries:
            _, whole = prefill_updates(3 * BLOCK, 50)
            _assert_reads_back(store, whole)
        visible.append((os.WIFSIGNALED(status), bool(entries)))
    assert (True, False) in visible and (True, True) in visible  # killed before and after the rename
    assert visible[-1] == (False, True)  # past the last call: it completed


def _assert_reads_back(store, whole):
    (entry,) = store.entries()
    with IOEngine(2) as io:
        for layer, keys, values in read_layers(entry.path, entry.meta, len(entry.meta.blocks), io):
            assert torch.equal(keys, whole[layer][0][:, :, : keys.shape[2]])
            assert torch.equal(values, whole[layer][1][:, :, : values.shape[2]])


def test_a_store_path_that_is_a_file_is_a_one_line_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(Exception, match="cannot use KV store|not a directory"):
        DocumentStore(tmp_path / "file")
