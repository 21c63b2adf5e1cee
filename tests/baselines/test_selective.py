"""What every baseline shares: exact plumbing at alpha = 1, tiers and budgets, attended counts, files and hooks."""

import pytest
import torch

from baseline_runs import BLOCK, MODES, RECENT, SINK, attended_count, config, dense, greedy, ids, run_watched
from kvtier.errors import ConfigError
from kvtier.kv.contract import tier_bytes
from kvtier.modes import KV_MODES, KVConfig, make_cache


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kv", MODES)
def test_alpha_one_equals_dense_bit_for_bit_with_most_kv_on_disk(tiny_llama, tmp_path, kv, batch):
    prompt = ids(batch, 140, batch)
    logits, seen, read, cache = run_watched(tiny_llama, config(kv, tmp_path, tiny_llama, 144, 1.0, batch), prompt, 4)
    assert torch.equal(logits, dense(tiny_llama, prompt, 4))
    for layer in cache.layers:  # 144 tokens: window of sink + recent - 1, one host block, the rest on disk
        tiers = layer.tier_tokens()
        assert tiers["device"] == SINK + RECENT - 1 and tiers["host"] <= BLOCK
        assert tiers["storage"] == 144 - tiers["device"] - tiers["host"] >= 3 * BLOCK
    assert all(step.positions.shape == (batch, step.tokens) for step in seen)  # every token, in position order
    assert all((step.positions == torch.arange(step.tokens).numpy()).all() for step in seen)
    assert read > 0 and not list(tmp_path.iterdir())  # close deleted the files


@pytest.mark.parametrize("kv", MODES)
def test_alpha_below_one_attends_sink_top_alpha_and_recent(tiny_llama, tmp_path, kv):
    kv_config = config(kv, tmp_path, tiny_llama, 155, 0.25, batch=2)
    _, seen, _, _ = run_watched(tiny_llama, kv_config, ids(2, 150, 3), 5)
    assert len(seen) == 2 * 5
    for step in seen:
        assert step.positions.shape == (2, attended_count(step.tokens, 0.25))
        for positions in step.positions:
            assert (positions[:SINK] == range(SINK)).all()
            assert (positions[-RECENT:] == range(step.tokens - RECENT, step.tokens)).all()  # ends with the new token
            assert (positions[1:] > positions[:-1]).all()


@pytest.mark.parametrize("kv", MODES)
def test_gemma3_sliding_layers_stay_dense_on_the_device(tiny_gemma3, tmp_path, kv):
    prompt = ids(1, 150, 6)
    cache = make_cache(tiny_gemma3, config(kv, tmp_path, tiny_gemma3, 156, 1.0), 156)
    try:
        logits = greedy(tiny_gemma3, cache, prompt, 6)
        assert [type(layer).__name__ for layer in cache.layers][::2] == ["DynamicSlidingWindowLayer"] * 2
        assert cache.layers[0].keys.shape[2] <= 16
        assert tier_bytes(cache, tiny_gemma3)["storage"] > 0
    finally:
        cache.close()
    assert torch.equal(logits, dense(tiny_gemma3, prompt, 6))


def test_the_host_tier_stays_within_its_budget(tiny_llama, tmp_path):
    cache = make_cache(tiny_llama, config("h2o", tmp_path, tiny_llama, 140, host_blocks=2), 140)
    try:
        greedy(tiny_llama, cache, ids(1, 120, 4), 20)  # 20 tokens retire into the pool: one more block spills
        sizes = tier_bytes(cache, tiny_llama)
        assert sizes["host"] <= 2 * BLOCK * 2 * 128 * 2 and sizes["storage"] > sizes["host"]
        assert all(layer.tier_tokens()["storage"] % BLOCK == 0 for layer in cache.layers)
    finally:
        cache.close()


@pytest.mark.parametrize("kv", MODES)
def test_a_device_budget_below_the_window_is_refused(tiny_llama, tmp_path, kv):
    with pytest.raises(ConfigError, match=r"sink \+ recent window .* raise device_kv_budget \(--device-kv-budget\)"):
        make_cache(tiny_llama, KVConfig(kv=kv, device_kv_budget="4KiB", recent=64, storage_dir=str(tmp_path)), 100)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("kv, host, reserve", [("infinigen", "64KiB", "partial key cache"),
                                              ("leoam", "16KiB", "abstract write buffer")])
def test_a_host_budget_below_the_modes_own_dram_is_refused(tiny_llama, tmp_path, kv, host, reserve):
    kv_config = KVConfig(kv=kv, device_kv_budget="1MiB", host_kv_budget=host, storage_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=rf"host KV budget .* cannot hold .*{reserve}.* raise host_kv_budget \(--host"):
        make_cache(tiny_llama, kv_config, 1000)


def test_every_baseline_is_a_kv_mode():
    assert set(MODES) <= set(KV_MODES)
    assert KVConfig(kv="leoam", alpha=0.1).validated().kv == "leoam"
    with pytest.raises(ConfigError, match="--alpha"):
        KVConfig(kv="h2o", alpha=1.5).validated()
