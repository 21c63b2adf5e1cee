"""The cache contract's mode-specific accessors: neutral answers from the modes that lack a thing, real ones from
the sparse cache (generation, the server and the evaluation read them without asking which mode a cache is)."""

from pathlib import Path

import pytest
import torch

from kvtier.kv.contract import KVCache
from kvtier.kv.model_geometry import full_attention_layers
from kvtier.modes import KVConfig, make_cache
from kvtier.sparse import SparseSettings, make_sparse_cache
from kvtier.sparse.cold.cold_image import IMAGE_PREFIX

PROMPT, STEPS = 200, 4


def _config(kv: str, tmp_path) -> KVConfig:
    """Budgets that put part of the prompt on disk in every tiered mode."""
    return KVConfig(kv=kv, device_kv_budget="32KiB", host_kv_budget="96KiB", storage_dir=str(tmp_path),
                    block_tokens=16, io_threads=2, sink=4, recent=16, alpha=0.3, beta=0.5)


def _decoded(model, cache: KVCache) -> KVCache:
    """The cache after a prefill of PROMPT tokens, `place_prompt` and STEPS greedy decode steps."""
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        logits = model(input_ids=ids, cache=cache).logits[:, -1]
        cache.place_prompt()
        for _ in range(STEPS):
            logits = model(input_ids=logits.argmax(-1, keepdim=True), cache=cache).logits[:, -1]
    return cache


@pytest.mark.parametrize("kv", ["dense", "offload", "h2o", "infinigen", "leoam"])
def test_modes_without_a_scorer_a_stored_prefix_or_sparse_tiers_answer_neutrally(tiny_llama, tmp_path, kv):
    entry = tmp_path / "entry"
    entry.mkdir()
    with _decoded(tiny_llama, make_cache(tiny_llama, _config(kv, tmp_path / "kv"), PROMPT + STEPS)) as cache:
        assert cache.scorer_restarts() == 0
        assert cache.stored_in_place() is None  # built on no stored prefix
        assert cache.sparse_view() is None
        cache.save_placed(entry, PROMPT)
        assert not list(entry.iterdir())  # nothing placed to store with a document
        files = cache.storage_files()
        if kv == "dense":
            assert files == []
        else:  # the disk tier's files, whose `direct` says whether reads bypass the page cache
            assert files and all(Path(file.path).parent == tmp_path / "kv" for file in files)
            assert all(file.direct for file in files)  # tmp_path is on a filesystem with O_DIRECT here


def test_the_sparse_cache_answers_with_its_own_files_scorer_plan_and_steps(tiny_llama, tmp_path):
    (tmp_path / "kv").mkdir()
    settings = SparseSettings(alpha=0.3, beta=0.5, sink=4, recent=16, crash_scorer_after_blocks=2)  # dies once
    cache = make_sparse_cache(tiny_llama, settings, PROMPT + STEPS, 1, str(tmp_path / "kv"), device_budget=32 * 1024,
                              host_budget=96 * 1024, tiered_layers=full_attention_layers(tiny_llama.config))
    with _decoded(tiny_llama, cache):
        assert [Path(file.path).suffix for file in cache.storage_files()] == [".kv", ".sketch"]
        assert cache.scorer_restarts() == 1 and cache.stored_in_place() is None
        sparse = cache.sparse_view()
        assert sparse is cache and sparse.scorer_host_fallbacks == 1
        assert sparse.plan is not None and sparse.hot_tokens == sparse.plan.hot_tokens > 0
        summary = sparse.step_summary()
        assert summary["pooled_cold"] > 0 and summary["selected_cold"] > 0
        moves, ping_pongs = sparse.ping_pong()
        assert moves >= ping_pongs >= 0
        assert sparse.io_backend in ("kernel-aio", "threads")
        assert sparse.scorer_round_trip_s(repeats=3) > 0
        entry = tmp_path / "entry"
        entry.mkdir()
        cache.save_placed(entry, PROMPT)
        (image,) = entry.glob(IMAGE_PREFIX + "*")  # the image a later run of these settings uses in place
        assert (image / "image.json").is_file() and not list(entry.glob(".tmp-*"))
