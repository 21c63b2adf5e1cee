"""Tiered sequences under the serving engine, on smollm2-135m: one engine, one model, paged and tiered decoding together.

A pool of 24 blocks of 16 tokens holds short prompts; a ~600-token prompt becomes a tiered sequence (device
window, host hot pool, cold pool on disk) and decodes in the same forwards as the paged ones.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvtier.docstore.document_store import DocumentStore
from kvtier.engine.sequence import SamplingParams
from kvtier.engine.serving_engine import EngineConfig, LLMEngine
from kvtier.errors import ConfigError
from kvtier.kv.model_geometry import model_geometry
from kvtier.kv_config import KVConfig
from kvtier.sparse.stats import MASS_BUCKETS
from kvtier.sparse.threads import machine_threads
from kvtier.tiered_kv import SparseTiers

pytestmark = pytest.mark.model

DOCUMENT = "A lighthouse keeper writes down every ship that passes the cape at night. " * 40  # ~600 tokens
SHORT = "Name three uses of a lighthouse."


@pytest.fixture(scope="module")
def llm():
    from kvtier.models.loader import load_model

    return load_model("smollm2-135m")


def engine_config(directory: Path, **fields) -> EngineConfig:
    return EngineConfig(**({"block_tokens": 16, "device_blocks": 24, "io_threads": 2, "swap_space": "16MiB",
                            "flash_path": str(directory / "flash.kvc"), "host_kv_budget": "16MiB",
                            "max_tiered_seqs": 4} | fields))


def kv_files(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if not name.startswith("flash"))


def test_at_alpha_1_tiered_and_paged_sequences_decode_together_as_a_dense_engine_would(llm, tmp_path):
    prompts = [DOCUMENT, SHORT, "The keeper's logbook says: " + DOCUMENT]
    sampling = SamplingParams(max_new_tokens=12)
    tiers = SparseTiers(llm, KVConfig(kv="sparse", alpha=1.0, storage_dir=str(tmp_path)))
    with LLMEngine.from_llm(llm, engine_config(tmp_path), tiers) as engine:
        outputs = engine.generate(prompts, sampling)
        assert kv_files(tmp_path) == []  # every tiered sequence's cold-pool files are gone with it
        assert engine.block_manager.num_free == 24
    assert [output.tiered for output in outputs] == [True, False, True]
    with LLMEngine.from_llm(llm, engine_config(tmp_path, device_blocks=None, device_kv_budget="256MiB")) as dense:
        expected = dense.generate(prompts, sampling)
    assert [output.token_ids for output in outputs] == [output.token_ids for output in expected]


def test_tiered_sequences_run_at_most_max_tiered_seqs_at_once_within_their_host_shares(llm, tmp_path):
    tiers = SparseTiers(llm, KVConfig(kv="sparse", storage_dir=str(tmp_path)))
    with LLMEngine.from_llm(llm, engine_config(tmp_path, max_tiered_seqs=2, host_kv_budget="8MiB"), tiers) as engine:
        for number in range(3):
            engine.add_request(f"Logbook {number}. " + DOCUMENT, SamplingParams(max_new_tokens=4))
        most, host = 0, 0
        while engine.has_unfinished():
            engine.step()
            running = engine.scheduler.tiered_running()
            most = max(most, len(running))
            host = max([host] + [seq.kv.tier_bytes()["host"] for seq in running])
        assert most == 2  # the third waited for a share
        assert 0 < host <= 4 << 20  # no hot pool outgrew its half of the 8 MiB


def test_forwards_in_which_tiered_sequences_decode_leave_a_core_to_each_ones_scorer(llm, tmp_path):
    tiers = SparseTiers(llm, KVConfig(kv="sparse", storage_dir=str(tmp_path)))
    forwarding, seen = tiers.forwarding, []

    @contextmanager
    def recording(decoding: int):
        with forwarding(decoding):
            seen.append((decoding, torch.get_num_threads()))
            yield

    tiers.forwarding = recording
    before = torch.get_num_threads()
    with LLMEngine.from_llm(llm, engine_config(tmp_path, max_tiered_seqs=2, host_kv_budget="8MiB"), tiers) as engine:
        engine.generate([DOCUMENT, "Logbook: " + DOCUMENT, SHORT], SamplingParams(max_new_tokens=4))
    assert {decoding for decoding, _ in seen} == {1, 2}  # prompt chunks alone run as set; each decode counts
    assert all(threads == max(1, machine_threads() - decoding) for decoding, threads in seen)
    assert torch.get_num_threads() == before


def test_a_host_budget_too_small_for_a_hot_pool_is_refused_in_one_line(llm, tmp_path):
    tiers = SparseTiers(llm, KVConfig(kv="sparse", storage_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="host KV budget"):
        LLMEngine.from_llm(llm, engine_config(tmp_path, host_kv_budget="64KiB"), tiers)


def test_requests_on_one_document_store_it_once_and_share_its_cold_pool(llm, tmp_path):
    store = DocumentStore(tmp_path / "store")
    storage = tmp_path / "kv"
    storage.mkdir()
    tiers = SparseTiers(llm, KVConfig(kv="sparse", storage_dir=str(storage)), store)
    questions = ["\nWho keeps the logbook?", "\nWhat passes the cape?"]
    with LLMEngine.from_llm(llm, engine_config(tmp_path), tiers) as engine:
        engine.generate([DOCUMENT + questions[0]], SamplingParams(max_new_tokens=4))  # prefills and stores it
        [entry] = store.entries()
        first_bytes = entry.nbytes
        written = []
        for question in questions:  # two at once, both reading the stored document in place
            engine.add_request(DOCUMENT + question, SamplingParams(max_new_tokens=4))
        while engine.has_unfinished():
            engine.step()
            written = [seq.kv.cache.io_stats().bytes_written for seq in engine.scheduler.tiered_running()] or written
        counters = tiers.counters()
    assert len(store.entries()) == 1  # stored once
    assert counters["reused_prompt_tokens"] > 0
    assert max(written) <= 0.05 * first_bytes  # each question writes a few pages beside the shared document


def test_a_second_request_for_a_document_being_stored_prefills_alongside_and_stores_nothing(llm, tmp_path):
    store = DocumentStore(tmp_path / "store")
    tiers = SparseTiers(llm, KVConfig(kv="sparse", storage_dir=str(tmp_path)), store)
    with LLMEngine.from_llm(llm, engine_config(tmp_path), tiers) as engine:
        outputs = engine.generate([DOCUMENT + "\nFirst?", DOCUMENT + "\nSecond?"], SamplingParams(max_new_tokens=3))
    assert [len(output.token_ids) for output in outputs] == [3, 3]
    assert len(store.entries()) == 1


def test_tiered_sequences_count_the_attention_mass_their_top_p_budget_kept(llm, tmp_path):
    tiers = SparseTiers(llm, KVConfig(kv="sparse", top_p=0.9, storage_dir=str(tmp_path)))
    with LLMEngine.from_llm(llm, engine_config(tmp_path), tiers) as engine:
        outputs = engine.generate([DOCUMENT, SHORT], SamplingParams(max_new_tokens=8))
    assert [output.tiered for output in outputs] == [True, False]
    counters = tiers.counters()
    steps = counters["mass_kept_count"]
    assert steps >= 6 and 0 < counters["mass_kept_sum"] / steps <= 1 + 1e-6  # its decode steps, each once
    buckets = [counters[f"mass_kept_le_{bound}"] for bound in MASS_BUCKETS]
    assert buckets == sorted(buckets) and buckets[-1] <= steps and counters["guard_events"] >= 0


def _logbooks(count: int) -> list[str]:
    return [f"Logbook {number}. " + DOCUMENT for number in range(count)]


def test_tiered_sequences_set_aside_and_brought_back_give_the_outputs_of_a_run_without_preemption(llm, tmp_path):
    kv = KVConfig(kv="sparse", alpha=0.2, storage_dir=str(tmp_path))
    sampling = SamplingParams(max_new_tokens=12)
    # One share: without a slice the three run one after another; with a 3-token slice they take turns, each set
    # aside (window and hot pool to flash) and brought back several times. Each runs alone in its forwards either way.
    with LLMEngine.from_llm(llm, engine_config(tmp_path, max_tiered_seqs=1, host_kv_budget="4MiB"),
                            SparseTiers(llm, kv)) as engine:
        expected = engine.generate(_logbooks(3), sampling)
        assert engine.scheduler.stats.tiered_set_asides == 0
    tiers = SparseTiers(llm, kv)
    with LLMEngine.from_llm(llm, engine_config(tmp_path, max_tiered_seqs=1, host_kv_budget="4MiB", tiered_slice=3),
                            tiers) as engine:
        outputs = engine.generate(_logbooks(3), sampling)
        stats = engine.scheduler.stats
        assert kv_files(tmp_path) == []  # set-aside files go with their sequences
    assert [output.token_ids for output in outputs] == [output.token_ids for output in expected]
    assert stats.tiered_set_asides >= 6 and stats.recomputes == 0
    counters = tiers.counters()
    geometry = model_geometry(llm.model)
    window = tiers.window_tokens() * geometry.token_bytes
    slack = geometry.num_layers * 4096  # each layer's region ends on a page
    assert counters["set_asides"] == stats.tiered_set_asides
    assert counters["set_aside_bytes"] / counters["set_asides"] <= (4 << 20) + window + slack  # never the cold pool


def test_a_request_aborted_while_set_aside_leaves_no_file(llm, tmp_path):
    tiers = SparseTiers(llm, KVConfig(kv="sparse", storage_dir=str(tmp_path)))
    config = engine_config(tmp_path, max_tiered_seqs=1, host_kv_budget="4MiB", tiered_slice=2)
    with LLMEngine.from_llm(llm, config, tiers) as engine:
        first, _ = (engine.add_request(prompt, SamplingParams(max_new_tokens=8)) for prompt in _logbooks(2))
        while engine.scheduler.stats.tiered_set_asides == 0:
            engine.step()
        assert [name for name in kv_files(tmp_path) if name.endswith(".aside")]
        engine.abort(first)
        while engine.has_unfinished():
            engine.step()
        assert kv_files(tmp_path) == []


def _damage(path: Path) -> None:
    """Flip one byte in every page of `path`."""
    with open(path, "r+b") as file:
        for offset in range(0, path.stat().st_size, 4096):
            file.seek(offset)
            byte = file.read(1)
            file.seek(offset)
            file.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("on_corrupt", ["recompute", "fail"])
def test_a_stored_document_found_damaged_while_decoding_costs_only_its_own_request(llm, tmp_path, on_corrupt):
    store = DocumentStore(tmp_path / "store", on_corrupt=on_corrupt)
    storage = tmp_path / "kv"
    storage.mkdir()
    kv = KVConfig(kv="sparse", alpha=1.0, storage_dir=str(storage))  # every cold token is read every step
    question, sampling = DOCUMENT + "\nWho keeps the logbook?", SamplingParams(max_new_tokens=6)
    with LLMEngine.from_llm(llm, engine_config(tmp_path), SparseTiers(llm, kv, store)) as engine:
        [first] = engine.generate([question], sampling)  # prefills and stores the document, its sparse image too
        [short_alone] = engine.generate([SHORT], sampling)
    [entry] = store.entries()
    [image] = entry.path.glob("sparse-*/cold.kv")
    _damage(image)  # the image's pages are read (and checked) only when a decode step fetches their tokens
    with LLMEngine.from_llm(llm, engine_config(tmp_path), SparseTiers(llm, kv, store)) as engine:
        tiered, short = engine.generate([question, SHORT], sampling)
        assert engine.scheduler.stats.checksum_failures == 1
    assert short.token_ids == short_alone.token_ids and not short.warnings  # its batch mate is untouched
    if on_corrupt == "recompute":
        assert "tiered KV unreadable, recomputed" in tiered.warnings[0] and tiered.recomputes == 1
        assert tiered.token_ids == first.token_ids  # prefilled afresh: the same answer
        assert entry.path not in [stored.path for stored in store.entries()]  # the damaged entry is gone
    else:
        assert tiered.finish_reason == "error" and "checksum" in tiered.warnings[0]
        assert [stored.path for stored in store.entries()] == [entry.path]  # kept, as `fail` says
