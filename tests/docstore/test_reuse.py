"""A prompt through the store: a stored prefix is loaded instead of computed, damage is recomputed, never used."""

import errno
import logging

import pytest
import torch

from kvtier.generation import generate
from kvtier.modes import KVConfig
from kvtier.docstore import DocumentStore
from kvtier.docstore.meta import CorruptEntry

NEW_TOKENS = 6


def ask(llm, document, store, question="What is it about ?", **options):
    return generate(llm, f"{document} {question}", NEW_TOKENS, progress=False, kv_store=store, **options)


def test_a_second_question_reuses_the_document_and_answers_as_a_cold_run(tiny_llm, document, store):
    cold = generate(tiny_llm, f"{document} Name one place .", NEW_TOKENS, progress=False)
    first = ask(tiny_llm, document, store)
    second = ask(tiny_llm, document, store, "Name one place .")
    assert first.reused_prompt_tokens == 0 and len(store.entries()) == 1
    assert second.reused_prompt_tokens >= first.prefill_tokens - 2 * 256
    assert second.token_ids == cold.token_ids
    assert len(store.entries()) == 1  # a question does not store a second copy of its document
    assert 0 < second.ttft_s and 0 < first.ttft_s


def test_a_question_that_finishes_while_another_stores_the_document_is_not_stored_twice(tiny_llm, document, store):
    """The second question starts while the first goes in (nothing is stored yet) and finishes first; the first then
    finds its entry and drops its own copy. Each question is longer than a block: their entries' ids differ."""
    asked = []

    def ask_another(cache) -> bool:
        if not asked:
            asked.append(ask(tiny_llm, document, store, "Name one place ." * 80))
        return False

    first = ask(tiny_llm, document, store, "What is it about ?" * 80, watch=ask_another)
    assert asked[0].reused_prompt_tokens == 0 == first.reused_prompt_tokens  # both prefilled the new document
    assert len(store.entries()) == 1
    assert not [path for path in store.root.iterdir() if path.name.startswith(".")]


def test_the_same_prompt_again_leaves_a_token_to_the_model(tiny_llm, document, store):
    first = ask(tiny_llm, document, store)
    again = ask(tiny_llm, document, store)
    assert 0 < again.reused_prompt_tokens < again.prefill_tokens and again.token_ids == first.token_ids


@pytest.mark.parametrize("damage", ["flip a K/V byte", "truncate kv.bin", "flip a meta byte"])
def test_a_damaged_entry_is_reported_dropped_and_recomputed(tiny_llm, document, store, caplog, damage):
    first = ask(tiny_llm, document, store)
    (entry,) = store.entries()
    _damage(entry, damage)
    with caplog.at_level(logging.WARNING):
        second = ask(tiny_llm, document, store)
    assert second.token_ids == first.token_ids and second.reused_prompt_tokens == 0
    assert "damaged" in caplog.text
    (fresh,) = store.entries()  # the recomputed prompt is stored again, intact
    assert ask(tiny_llm, document, store).reused_prompt_tokens > 0


def test_on_corrupt_fail_raises_and_keeps_the_entry(tiny_llm, document, tmp_path):
    store = DocumentStore(tmp_path / "store", on_corrupt="fail")
    ask(tiny_llm, document, store)
    (entry,) = store.entries()
    _damage(entry, "flip a K/V byte")
    with pytest.raises(CorruptEntry, match="fails its checksum"):
        ask(tiny_llm, document, store)
    assert store.entries()[0].id == entry.id


@pytest.mark.parametrize("mode", ["offload", "sparse"])
def test_every_kv_mode_uses_the_stored_prefix(tiny_llm, document, store, tmp_path, mode):
    config = KVConfig(kv=mode, device_kv_budget="64KiB", host_kv_budget="256KiB", storage_dir=str(tmp_path))
    cold = generate(tiny_llm, f"{document} What is it about ?", NEW_TOKENS, config, progress=False)
    ask(tiny_llm, document, store, kv_config=KVConfig())  # stored by a dense run: every mode prefills densely
    warm = ask(tiny_llm, document, store, kv_config=config)
    assert warm.reused_prompt_tokens > 0 and warm.token_ids == cold.token_ids


def test_a_full_disk_while_storing_warns_and_answers(tiny_llm, document, store, monkeypatch, caplog):
    cold = generate(tiny_llm, f"{document} What is it about ?", NEW_TOKENS, progress=False)
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvtier.docstore.entry.os.pwrite", full)  # the records' writes
    with caplog.at_level(logging.WARNING):
        answer = ask(tiny_llm, document, store)
    assert answer.token_ids == cold.token_ids and store.entries() == []
    assert "No space left on device" in caplog.text
    assert not list(store.root.iterdir())


def test_a_store_of_another_dtype_is_not_used(tiny_llm, document, store, caplog):
    ask(tiny_llm, document, store)
    tiny_llm.dtype, dtype = torch.bfloat16, tiny_llm.dtype  # what identity_of reads
    try:
        with caplog.at_level(logging.WARNING):
            other = ask(tiny_llm, document, store, "Name one place .")
    finally:
        tiny_llm.dtype = dtype
    assert other.reused_prompt_tokens == 0 and "for another model, dtype or layout" in caplog.text


def _damage(entry, how: str) -> None:
    if how == "flip a meta byte":
        path = entry.path / "meta.json"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        return
    path = entry.path / "kv.bin"
    if how == "truncate kv.bin":
        with open(path, "r+b") as file:
            file.truncate(path.stat().st_size // 2)
        return
    with open(path, "r+b") as file:
        file.seek(entry.meta.block_span + 3)
        byte = file.read(1)
        file.seek(-1, 1)
        file.write(bytes([byte[0] ^ 0x10]))


def test_a_read_only_store_warns_and_answers(tiny_llm, document, store, monkeypatch, caplog):
    def read_only(directory, meta):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("kvtier.docstore.reuse.EntryWriter", read_only)
    with caplog.at_level(logging.WARNING):
        answer = ask(tiny_llm, document, store)
    assert answer.decode_tokens > 0 and store.entries() == []
    assert "cannot write to the KV store" in caplog.text and "Read-only file system" in caplog.text
