"""`--kv sparse` and the store: a stored document's cold pool is used where it lies, checked, never rewritten."""

import dataclasses
import hashlib
import itertools
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.sparse import threads as threads_module
from kvtier.errors import ChecksumError
from kvtier.docstore.recovery import RecomputeDiverged
from kvtier.generation import generate
from kvtier.modes import KVConfig
from kvtier.sparse.cold import cold_image
from kvtier.sparse.cold.cold_image import IMAGE_PREFIX, ColdImage, CorruptImage
from kvtier.sparse.cache import SparseCache
from kvtier.sparse.cold.cold_pool import ColdPool
from kvtier.sparse.lookahead import Lookahead
from kvtier.docstore import DocumentStore
from kvtier.docstore import entry as entry_module
from kvtier.docstore import document_store
from kvtier.storage import PAGE, SECTOR, IOEngine, direct_file, round_up
from kvtier.storage.sealed_json import unseal
from kvtier.docstore.entry import read_layers
from store_entries import KilledAt

NEW_TOKENS = 6
FIRST, SECOND = "What is it about ?", "Name one place ."
LONG_QUESTION = "Name one place . " * 330  # more whole blocks than the document: stored


@pytest.fixture()
def sparse(tmp_path) -> KVConfig:
    return KVConfig(kv="sparse", device_kv_budget="64KiB", host_kv_budget="256KiB", storage_dir=str(tmp_path))


def ask(llm, document, store, question, config, new_tokens=NEW_TOKENS):
    return generate(llm, f"{document} {question}", new_tokens, config, progress=False, kv_store=store)


def image_dir(entry) -> Path:
    """The entry's one sparse image."""
    (directory,) = entry.path.glob(IMAGE_PREFIX + "*")
    return directory


def image_files(store) -> dict[str, str]:
    (entry,) = store.entries()
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in image_dir(entry).iterdir()}


def test_a_second_question_uses_the_stored_cold_pool_in_place(tiny_llm, document, store, sparse, monkeypatch):
    ask(tiny_llm, document, store, FIRST, sparse)
    stored = image_files(store)
    assert {"cold.kv", "cold.sketch", "cold.kv.crc", "cold.sketch.crc", "tables.npz", "image.json"} <= set(stored)
    cold = generate(tiny_llm, f"{document} {SECOND}", 24, sparse, progress=False)
    adopted = []
    monkeypatch.setattr(ColdPool, "adopt", lambda pool, layer, positions, adopt=ColdPool.adopt: (
        adopted.append(len(positions)), adopt(pool, layer, positions)))
    warm = ask(tiny_llm, document, store, SECOND, sparse, 24)
    assert warm.reused_prompt_tokens > 0 and warm.token_ids == cold.token_ids
    assert len(adopted) == 2 and min(adopted) > 0  # every tiered layer took its cold slots from the image
    assert warm.disk_bytes_written > 0  # the decode's moves were written (to the run's own files) ...
    assert image_files(store) == stored  # ... and the image is as it was


def test_a_question_that_extends_a_stored_document_stores_its_image_from_the_one_it_reused(
        tiny_llm, document, store, sparse, monkeypatch):
    """doc, then doc + a long first question (reusing doc's image, publishing the longer prompt), then doc + that
    question + another: the third uses the second's image in place, which holds the first image's records for the
    slots it adopted and its own for the rest."""
    ask(tiny_llm, document, store, FIRST, sparse)
    extended = f"{document} {LONG_QUESTION}"
    adopted = []
    monkeypatch.setattr(ColdPool, "adopt", lambda pool, layer, positions, adopt=ColdPool.adopt: (
        adopted.append(len(positions)), adopt(pool, layer, positions)))
    second = ask(tiny_llm, extended, store, SECOND, sparse)
    assert second.reused_prompt_tokens > 0 and len(adopted) == 2 and len(store.entries()) == 2
    longer = max(store.entries(), key=lambda entry: len(entry.meta.blocks))
    assert_image_holds_the_stored_kv(longer)
    cold = generate(tiny_llm, f"{extended} {FIRST}", 24, sparse, progress=False)
    by_second, written, marks = adopted[:], [], []  # written[marks[0]:marks[1]]: the placement's cold writes
    monkeypatch.setattr(ColdPool, "append", lambda pool, layer, keys, values, positions, append=ColdPool.append: (
        written.append(positions), append(pool, layer, keys, values, positions)))
    monkeypatch.setattr(SparseCache, "place_prompt", lambda cache, place=SparseCache.place_prompt: (
        marks.append(len(written)), place(cache), marks.append(len(written))))
    third = ask(tiny_llm, extended, store, FIRST, sparse, new_tokens=24)
    assert third.reused_prompt_tokens == longer.meta.block_tokens * len(longer.meta.blocks)
    assert third.token_ids == cold.token_ids
    assert min(adopted[2:]) > max(by_second)  # every tiered layer adopted the first question's cold slots too
    # ... and wrote none of the positions the second image covers (the second run's recent window was not pooled)
    imaged = unseal((image_dir(longer) / "image.json").read_bytes())["tokens"]
    assert imaged > second.reused_prompt_tokens
    assert all((positions >= imaged).all() for positions in written[marks[0] : marks[1]])


def test_a_damaged_page_found_while_copying_the_image_it_reused_is_recomputed(tiny_llm, document, store, sparse,
                                                                               caplog):
    """A page holding records of the base image and of the run is checked as it is merged: with one new token (no
    decode step reads the cold pool), only that check can find the damage."""
    ask(tiny_llm, document, store, FIRST, sparse)
    (damaged,) = store.entries()
    _damage(store, "flip cold.kv")
    _damage(store, "flip cold.sketch")
    extended = f"{document} {LONG_QUESTION} {SECOND}"
    cold = generate(tiny_llm, extended, 1, sparse, progress=False)
    with caplog.at_level(logging.WARNING):
        warm = generate(tiny_llm, extended, 1, sparse, progress=False, kv_store=store)
    assert warm.reused_prompt_tokens == 0 and warm.token_ids == cold.token_ids
    assert f"KV store entry {damaged.id} is damaged" in caplog.text
    (fresh,) = store.entries()  # the extended prompt, stored cold, with an image of its own
    assert_image_holds_the_stored_kv(fresh)


def assert_image_holds_the_stored_kv(entry) -> None:
    """Every page of the entry's image holding an imaged record checks out, and every imaged cold K|V record is the
    K/V the entry stores for its position."""
    directory = image_dir(entry)
    image = ColdImage.open(entry.path, unseal((directory / "image.json").read_bytes())["key"], 1 << 30)
    kv = np.fromfile(directory / "cold.kv", dtype=np.uint8)
    sketches = np.fromfile(directory / "cold.sketch", dtype=np.uint8)
    with IOEngine(2) as io:
        stored = list(read_layers(entry.path, entry.meta, len(entry.meta.blocks), io))
    for (layer, keys, values), imaged in zip(stored, image.layers):
        for data, layout, pages in ((kv, image.kv_layout, image.kv_pages),
                                    (sketches, image.sketch_layout, image.sketch_pages)):
            start, nbytes = layout.region_offset(layer, 0), round_up(len(imaged.cold) * layout.record_bytes, pages.page)
            assert pages.mismatch(start, data[start : start + nbytes]) is None
        start, size = image.kv_layout.region_offset(layer, 0), image.kv_layout.record_bytes
        records = kv[start : start + len(imaged.cold) * size].reshape(len(imaged.cold), size)
        index = torch.from_numpy(imaged.cold)
        expected = torch.cat([keys[0][:, index].transpose(0, 1).reshape(len(index), -1),
                              values[0][:, index].transpose(0, 1).reshape(len(index), -1)], dim=1)
        assert len(index) and np.array_equal(records, expected.contiguous().view(torch.uint8).numpy())


def test_the_image_counts_toward_the_stores_bound(tiny_llm, document, tmp_path, sparse):
    store = DocumentStore(tmp_path / "store")
    ask(tiny_llm, document, store, FIRST, sparse)
    (entry,) = store.entries()
    assert entry.nbytes > entry.meta.nbytes + 2 * PAGE  # kv.bin, meta.json and the image's cold records
    bounded = DocumentStore(tmp_path / "store", size_limit=entry.nbytes)
    other = KVConfig(**{**vars(sparse), "kv": "dense"})
    ask(tiny_llm, "Name one place . " * 200, bounded, FIRST, other)  # another document: the first is evicted
    assert len(bounded.entries()) == 1 and bounded.entries()[0].id != entry.id


def test_placement_after_reuse_writes_no_token_of_the_stored_prefix(tiny_llm, document, store, sparse, monkeypatch):
    ask(tiny_llm, document, store, FIRST, sparse)
    written = []
    monkeypatch.setattr(ColdPool, "append", lambda pool, layer, keys, values, positions, append=ColdPool.append: (
        written.append(positions), append(pool, layer, keys, values, positions)))
    warm = ask(tiny_llm, document, store, SECOND, sparse, new_tokens=1)  # prefill and placement only
    assert all((positions >= warm.reused_prompt_tokens).all() for positions in written)  # only the question's


def every_token(config: KVConfig) -> KVConfig:
    """`config` attending every pooled token: its choice cannot depend on which tokens a run placed hot or cold.

    A stored image places a question's few tokens hot where a cold run ranks them, so at alpha 0.2 the same chosen
    tokens may count as hot in one run and cold in the other, and a layer's candidates are sized by its last cold
    picks (lookahead.py): the two runs may then attend different tokens. Attending all of them, equal tokens out say
    that the K/V read from the image are the ones a cold run computes."""
    return KVConfig(**{**vars(config), "alpha": 1.0})


def test_a_partly_shared_prompt_places_the_rest_itself(tiny_llm, document, store, sparse):
    """A prompt sharing only the document's first blocks: the image covers those, the rest is split as in a cold run
    (the hot pool stays within its budget)."""
    sparse = every_token(sparse)
    ask(tiny_llm, document, store, FIRST, sparse)
    changed = document[: len(document) // 3] + " Name one place . " * 120
    cold = generate(tiny_llm, f"{changed} {SECOND}", NEW_TOKENS, sparse, progress=False)
    warm = ask(tiny_llm, changed, store, SECOND, sparse)
    assert 0 < warm.reused_prompt_tokens < warm.prefill_tokens / 2 and warm.token_ids == cold.token_ids
    assert warm.kv_bytes["host"] <= cold.kv_bytes["host"] + 64 * 2 * 2 * 2 * 16 * 4  # + one demote batch


@pytest.mark.parametrize("first_mode", ["dense", "offload", "sparse with other settings"])
def test_a_document_stored_without_these_sparse_tiers_gains_them_from_the_first_sparse_question(
        tiny_llm, document, store, sparse, caplog, monkeypatch, first_mode):
    first = KVConfig(**{**vars(sparse), "score_bits": 8}) if first_mode.startswith("sparse") else \
        KVConfig(kv=first_mode, storage_dir=sparse.storage_dir)
    ask(tiny_llm, document, store, FIRST, first)
    (entry,) = store.entries()
    before = set(entry.path.glob(IMAGE_PREFIX + "*"))
    cold = generate(tiny_llm, f"{document} {SECOND}", NEW_TOKENS, sparse, progress=False)
    with caplog.at_level(logging.INFO):
        placed = ask(tiny_llm, document, store, SECOND, sparse)
    assert "holds no sparse tiers for these settings yet" in caplog.text
    assert placed.reused_prompt_tokens > 0 and placed.token_ids == cold.token_ids
    (gained,) = set(entry.path.glob(IMAGE_PREFIX + "*")) - before  # the entry now holds this run's tiers too
    adopted = []
    monkeypatch.setattr(ColdPool, "adopt", lambda pool, layer, positions, adopt=ColdPool.adopt: (
        adopted.append(len(positions)), adopt(pool, layer, positions)))
    warm = ask(tiny_llm, document, store, FIRST, sparse)
    assert len(adopted) == 2 and min(adopted) > 0  # the next question places nothing: it takes the gained tiers
    assert warm.reused_prompt_tokens > 0 and len(store.entries()) == 1


@pytest.mark.parametrize("damage", ["flip image.json", "flip tables.npz", "flip cold.kv.crc", "flip cold.sketch.crc",
                                    "truncate cold.kv", "truncate cold.sketch", "remove tables.npz"])
def test_a_damaged_image_is_reported_dropped_and_recomputed(tiny_llm, document, store, sparse, caplog, damage):
    ask(tiny_llm, document, store, FIRST, sparse)
    cold = generate(tiny_llm, f"{document} {SECOND}", NEW_TOKENS, sparse, progress=False)
    _damage(store, damage)
    with caplog.at_level(logging.WARNING):
        warm = ask(tiny_llm, document, store, SECOND, sparse)
    assert "damaged" in caplog.text and warm.reused_prompt_tokens == 0 and warm.token_ids == cold.token_ids
    (fresh,) = store.entries()  # the recomputed prompt stored again, with a whole image
    assert ask(tiny_llm, document, store, FIRST, sparse).reused_prompt_tokens > 0


@pytest.mark.parametrize("damage", ["flip cold.kv", "flip cold.sketch"])
def test_damaged_stored_records_found_while_decoding_are_recomputed(tiny_llm, document, store, sparse, caplog, damage):
    """Cold records are checked when a step reads them (reading them all up front would read the whole pool): the
    answer starts over cold, and the tokens streamed before the damage showed are not streamed again."""
    ask(tiny_llm, document, store, FIRST, sparse)
    cold = generate(tiny_llm, f"{document} {SECOND}", NEW_TOKENS, sparse, progress=False)
    (damaged,) = store.entries()
    _damage(store, damage)
    streamed, texts = [], []
    with caplog.at_level(logging.WARNING):
        warm = generate(tiny_llm, f"{document} {SECOND}", NEW_TOKENS, sparse, progress=False, kv_store=store,
                        on_token=streamed.append, on_text=texts.append)
    assert warm.token_ids == streamed == cold.token_ids and "".join(texts) == cold.text
    assert warm.reused_prompt_tokens == 0 and 0 < warm.ttft_s
    (warning,) = [record.getMessage() for record in caplog.records if record.name == document_store.__name__]
    assert f"KV store entry {damaged.id} is damaged" in warning and "checksum mismatch" in warning
    (fresh,) = store.entries()  # the recomputed prompt stored again, with a whole image
    again = ask(tiny_llm, document, store, SECOND, sparse)
    assert again.reused_prompt_tokens > 0 and again.token_ids == cold.token_ids
    assert [entry.id for entry in store.entries()] == [fresh.id]  # its image opened: nothing was reported damaged


def test_a_recomputed_answer_that_differs_from_the_streamed_tokens_stops_with_an_error(tiny_llm, document, store,
                                                                                     sparse):
    """A `choose` whose draws do not repeat (sampling) cannot give the streamed tokens again: no divergent answer."""
    ask(tiny_llm, document, store, FIRST, sparse)
    _damage(store, "flip cold.kv")
    draws, streamed = itertools.count(5), []
    with pytest.raises(RecomputeDiverged, match="differs from the one already streamed at new token 1"):
        generate(tiny_llm, f"{document} {SECOND}", NEW_TOKENS, sparse, progress=False, kv_store=store,
                 on_token=streamed.append, choose=lambda logits: next(draws))
    assert streamed == [5]  # the first attempt's one token, not the second attempt's


def test_on_corrupt_fail_raises_damage_found_while_decoding_and_keeps_the_entry(tiny_llm, document, tmp_path, sparse):
    store = DocumentStore(tmp_path / "store", on_corrupt="fail")
    ask(tiny_llm, document, store, FIRST, sparse)
    (entry,) = store.entries()
    _damage(store, "flip cold.kv")
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        ask(tiny_llm, document, store, SECOND, sparse)
    assert [kept.id for kept in store.entries()] == [entry.id]


def test_on_corrupt_fail_raises_and_keeps_the_entry(tiny_llm, document, tmp_path, sparse):
    store = DocumentStore(tmp_path / "store", on_corrupt="fail")
    ask(tiny_llm, document, store, FIRST, sparse)
    _damage(store, "flip tables.npz")
    with pytest.raises(CorruptImage, match="tables.npz: fails its checksum"):
        ask(tiny_llm, document, store, SECOND, sparse)
    assert len(store.entries()) == 1


def test_a_writer_killed_while_storing_the_image_leaves_a_whole_entry_or_none(tiny_llm, document, tmp_path, sparse,
                                                                              monkeypatch):
    torch.set_num_threads(1)  # the forked writer must not need the parent's thread pool, in prefill or decode
    monkeypatch.setattr(threads_module, "machine_threads", lambda: 1)
    visible, point = [], 0
    while not visible or visible[-1][0]:  # every other file call of the cache, its image and the entry, until one
        point += 2                        # run goes past the last
        root = tmp_path / f"store-{point}"
        child = os.fork()
        if child == 0:
            cold_image.os = entry_module.os = document_store.os = direct_file.os = KilledAt(point)
            ask(tiny_llm, document, DocumentStore(root), FIRST, sparse, new_tokens=1)
            os._exit(0)
        _, status = os.waitpid(child, 0)
        store = DocumentStore(root)  # removes what the dead writer left
        assert not [path for path in root.iterdir() if path.name.startswith(".")]
        if store.entries():
            assert (image_dir(store.entries()[0]) / "image.json").exists()  # the image is part of the publish
            assert ask(tiny_llm, document, store, SECOND, sparse, new_tokens=2).reused_prompt_tokens > 0
            assert len(store.entries()) == 1  # its image opened: nothing was reported damaged
        visible.append((os.WIFSIGNALED(status), bool(store.entries())))
    assert (True, False) in visible and (True, True) in visible and visible[-1] == (False, True)


def _damage(store, how: str) -> None:
    action, name = how.split(" ")
    (entry,) = store.entries()
    path = image_dir(entry) / name
    if action == "remove":
        path.unlink()
    elif action == "truncate":
        os.truncate(path, path.stat().st_size - PAGE)
    elif name in ("cold.kv", "cold.sketch"):  # a byte in every stored sector: whichever a step reads is damaged
        data = bytearray(path.read_bytes())
        data[7::SECTOR] = bytes(byte ^ 0x10 for byte in data[7::SECTOR])
        path.write_bytes(bytes(data))
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))


def test_the_lookaheads_candidates_are_read_from_the_image_where_they_lie(tiny_llm, document, store, sparse,
                                                                          monkeypatch):
    settings = KVConfig.sparse_settings
    monkeypatch.setattr(KVConfig, "sparse_settings", lambda config: dataclasses.replace(
        settings(config), lookahead_skip=1, lookahead_min_cold=1))  # every layer after the first is predicted
    taken = []

    def take(lookahead, tier, take=Lookahead.take):
        candidates = take(lookahead, tier)
        taken.append(candidates is not None)
        return candidates

    monkeypatch.setattr(Lookahead, "take", take)
    sparse = every_token(sparse)
    ask(tiny_llm, document, store, FIRST, sparse)
    cold = generate(tiny_llm, f"{document} {SECOND}", 24, sparse, progress=False)
    taken.clear()
    warm = ask(tiny_llm, document, store, SECOND, sparse, 24)  # the scorer reads candidates in the image's file
    assert warm.reused_prompt_tokens > 0 and warm.token_ids == cold.token_ids
    assert any(taken)
