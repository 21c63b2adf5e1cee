"""`--kv offload` and the store: the stored prefix's K/V are read where they lie, never spilled again, and checked
on every read."""

import logging

import pytest

from kvtier.generation import generate
from kvtier.kv.offload import TieredStore
from kvtier.modes import KVConfig
from kvtier.storage import PAGE
from kvtier.docstore import DocumentStore
from kvtier.docstore import document_store
from kvtier.docstore.meta import CorruptEntry

NEW_TOKENS = 24
FIRST, SECOND = "What is it about ?", "Name one place ."


def offload(tmp_path, block_tokens: int = 64) -> KVConfig:
    return KVConfig(kv="offload", device_kv_budget="64KiB", host_kv_budget="256KiB", storage_dir=str(tmp_path),
                    block_tokens=block_tokens)


def ask(llm, document, store, question, config, **options):
    return generate(llm, f"{document} {question}", NEW_TOKENS, config, progress=False, kv_store=store, **options)


def disk_tiers(cache) -> list[tuple[int, int]]:
    """(tokens read from the entry, tokens in the run's own file) of each tiered layer."""
    store: TieredStore = cache.store
    return [(store.base_tokens[layer], store.stored_blocks[layer] * store.layout.block_tokens)
            for layer in store.tier_of_layer]


def test_a_second_question_writes_none_of_the_stored_prefix(tiny_llm, document, store, tmp_path):
    config = offload(tmp_path)
    first = ask(tiny_llm, document, store, FIRST, config)
    cold = generate(tiny_llm, f"{document} {SECOND}", NEW_TOKENS, config, progress=False)
    tiers = []
    warm = ask(tiny_llm, document, store, SECOND, config, watch=lambda cache: tiers.append(disk_tiers(cache)))
    assert warm.reused_prompt_tokens > 0 and warm.token_ids == cold.token_ids
    assert first.disk_bytes_written > 0 and warm.disk_bytes_written == 0
    assert all(base > 0 and own == 0 for base, own in tiers[-1])  # the layers' disk tokens are all the entry's
    assert warm.disk_bytes_read > 0  # ... read from it every step


def test_a_long_question_stores_the_tokens_past_the_prefix_in_its_own_file(tiny_llm, document, store, tmp_path):
    """80-token blocks over the entry's 64-token ones: a layer reads the entry's blocks up to one past its base and
    cuts them; the question's first spill crosses the prefix's end and is split between the base and the file."""
    config = offload(tmp_path, block_tokens=80)
    ask(tiny_llm, document, store, FIRST, config)
    question = f"{SECOND} " * 250
    cold = generate(tiny_llm, f"{document} {question}", NEW_TOKENS, config, progress=False)
    tiers = []
    warm = ask(tiny_llm, document, store, question, config, watch=lambda cache: tiers.append(disk_tiers(cache)))
    assert warm.token_ids == cold.token_ids and warm.reused_prompt_tokens % 80
    in_prefix = warm.reused_prompt_tokens // 80 * 80  # every whole block of the prefix
    assert all(base == in_prefix and own > 0 for base, own in tiers[-1])


def test_the_entry_stays_readable_when_it_is_removed_meanwhile(tiny_llm, document, store, tmp_path):
    config = offload(tmp_path)
    ask(tiny_llm, document, store, FIRST, config)
    cold = generate(tiny_llm, f"{document} {SECOND}", NEW_TOKENS, config, progress=False)
    cleared = []  # once the question is in (evicted by another process, say)
    warm = ask(tiny_llm, document, store, SECOND, config, watch=first_time(lambda: cleared.append(store.clear()[0])))
    assert cleared == [1] and warm.reused_prompt_tokens > 0 and warm.token_ids == cold.token_ids


def first_time(action):
    """A `watch` that runs `action` at its first call (after the question's prefill) and never cancels."""
    calls = []

    def watch(cache) -> bool:
        if not calls:
            action()
        calls.append(cache)
        return False

    return watch


def flip_every_page(entry) -> None:
    """A byte in every page of kv.bin: whichever record a read takes is damaged."""
    with open(entry.path / "kv.bin", "r+b") as file:
        data = bytearray(file.read())
        data[7::PAGE] = bytes(byte ^ 0x10 for byte in data[7::PAGE])
        file.seek(0)
        file.write(data)


def test_a_damaged_record_read_while_decoding_is_recomputed(tiny_llm, document, store, tmp_path, caplog):
    """The replay checked the prefix; the records are damaged after it, and the decode's reads find it: the answer
    starts over cold, the tokens already streamed are not streamed again."""
    config = offload(tmp_path)
    ask(tiny_llm, document, store, FIRST, config)
    (damaged,) = store.entries()
    cold = generate(tiny_llm, f"{document} {SECOND}", NEW_TOKENS, config, progress=False)
    streamed = []
    with caplog.at_level(logging.WARNING):  # flipped once the question is in: the decode's reads find it
        warm = ask(tiny_llm, document, store, SECOND, config, on_token=streamed.append,
                   watch=first_time(lambda: flip_every_page(damaged)))
    assert warm.token_ids == streamed == cold.token_ids and warm.reused_prompt_tokens == 0
    (warning,) = [record.getMessage() for record in caplog.records if record.name == document_store.__name__]
    assert f"KV store entry {damaged.id} is damaged" in warning and "fails its checksum" in warning
    (fresh,) = store.entries()  # the recomputed prompt, stored again, intact
    again = ask(tiny_llm, document, store, SECOND, config)
    assert again.reused_prompt_tokens > 0 and again.token_ids == cold.token_ids


def test_on_corrupt_fail_raises_a_damaged_record_read_while_decoding(tiny_llm, document, tmp_path):
    store = DocumentStore(tmp_path / "store", on_corrupt="fail")
    config = offload(tmp_path)
    ask(tiny_llm, document, store, FIRST, config)
    (entry,) = store.entries()
    with pytest.raises(CorruptEntry, match="kv.bin: block 0 layer . [KV] head . fails its checksum"):
        ask(tiny_llm, document, store, SECOND, config, watch=first_time(lambda: flip_every_page(entry)))
    assert [kept.id for kept in store.entries()] == [entry.id]
