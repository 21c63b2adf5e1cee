"""A benchmark prompt's rows through the document store: read back exactly, a damaged entry recomputed or raised."""

import logging

import pytest
import torch

from kvtier.eval.sparse.prefill_tape import PrefillTape, record
from kvtier.eval.sparse.stored_rows import StoredRows
from kvtier.docstore import DocumentStore
from kvtier.docstore.meta import KV, CorruptEntry

CHUNK = 64  # the tiny model's store blocks are 64 tokens (head_dim 16, float32: a 4 KiB record)


def _ids(tiny_llm, rows: int) -> torch.Tensor:
    vocab = tiny_llm.model.config.vocab_size
    return torch.randint(3, vocab, (rows, 300), generator=torch.Generator().manual_seed(rows))  # 256 recorded


def _tape(tiny_llm, ids: torch.Tensor, store: DocumentStore) -> tuple[PrefillTape, StoredRows, int]:
    """The tape through `store`, its StoredRows and the chunks its progress counted."""
    chunks = []
    rows = StoredRows(tiny_llm, store, CHUNK, lambda: chunks.append(1))
    return record(tiny_llm.model, ids, CHUNK, lambda: chunks.append(1), rows), rows, len(chunks)


def _assert_same(tape: PrefillTape, other: PrefillTape, exact: bool = True) -> None:
    assert [(layer, keys.shape) for layer, keys, _ in tape.updates] == \
           [(layer, keys.shape) for layer, keys, _ in other.updates]
    for (_, keys, values), (_, other_keys, other_values) in zip(tape.updates, other.updates):
        torch.testing.assert_close(keys, other_keys, rtol=0 if exact else None, atol=0 if exact else None)
        torch.testing.assert_close(values, other_values, rtol=0 if exact else None, atol=0 if exact else None)


def test_a_rerun_reads_the_rows_back_instead_of_prefilling_them(tiny_llm, tmp_path, monkeypatch):
    store = DocumentStore(tmp_path / "store")
    ids = _ids(tiny_llm, rows=2)
    first, rows, chunks = _tape(tiny_llm, ids, store)
    assert rows.rows_read == 0 and len(store.entries()) == 2 and chunks == 2 * 4
    _assert_same(first, record(tiny_llm.model, ids, CHUNK), exact=False)  # what a tape without the store records

    forward = tiny_llm.model.forward
    passes = []
    monkeypatch.setattr(tiny_llm.model, "forward", lambda *args, **kwargs: passes.append(1) or forward(*args, **kwargs))
    again, rows, chunks = _tape(tiny_llm, ids, store)
    assert rows.rows_read == 2 and rows.bytes_read > 0 and chunks == 2 * 4
    assert not passes  # the model never ran
    _assert_same(again, first)


def _flip_a_kv_byte(store: DocumentStore) -> None:
    (entry,) = store.entries()
    data = bytearray((entry.path / KV).read_bytes())
    data[100] ^= 0xFF
    (entry.path / KV).write_bytes(bytes(data))


def test_a_damaged_entry_is_dropped_and_the_row_prefilled_and_stored_again(tiny_llm, tmp_path, caplog):
    store = DocumentStore(tmp_path / "store")
    ids = _ids(tiny_llm, rows=1)
    first, _, _ = _tape(tiny_llm, ids, store)
    _flip_a_kv_byte(store)
    with caplog.at_level(logging.WARNING):
        again, rows, _ = _tape(tiny_llm, ids, store)
    assert rows.rows_read == 0 and "damaged" in caplog.text
    _assert_same(again, first)
    assert _tape(tiny_llm, ids, store)[1].rows_read == 1  # stored again, intact


def test_on_corrupt_fail_raises_and_keeps_the_entry(tiny_llm, tmp_path):
    ids = _ids(tiny_llm, rows=1)
    _tape(tiny_llm, ids, DocumentStore(tmp_path / "store"))
    store = DocumentStore(tmp_path / "store", on_corrupt="fail")
    _flip_a_kv_byte(store)
    (entry,) = store.entries()
    with pytest.raises(CorruptEntry, match="fails its checksum"):
        _tape(tiny_llm, ids, store)
    assert [kept.id for kept in store.entries()] == [entry.id]
