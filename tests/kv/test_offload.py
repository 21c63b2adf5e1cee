import torch

from kvtier.kv.contract import tier_bytes
from kvtier.modes import KVConfig, make_cache
from kvtier.kv.offload import OffloadLayer

BLOCK = 16


def _run(model, kv_config, ids, steps, chunk=40):
    """Chunked prefill then `steps` greedy steps; returns all logits and the cache (still open)."""
    cache = make_cache(model, kv_config, ids.shape[1] + steps, batch_size=ids.shape[0], model_id="tiny")
    outputs = []
    with torch.inference_mode():
        for start in range(0, ids.shape[1], chunk):
            outputs.append(model(input_ids=ids[:, start : start + chunk], cache=cache).logits[:, -1])
        for _ in range(steps):
            token = outputs[-1].argmax(-1, keepdim=True)
            outputs.append(model(input_ids=token, cache=cache).logits[:, -1])
    return torch.stack(outputs), cache


def _offload_config(tmp_path, model, device_tokens=BLOCK, host_tokens=2 * BLOCK, batch=1):
    per_token = batch * 2 * model.config.num_key_value_heads * (model.config.hidden_size // model.config.num_attention_heads) * 4
    layers = model.config.num_hidden_layers
    return KVConfig(
        kv="offload",
        device_kv_budget=device_tokens * per_token * layers,
        host_kv_budget=host_tokens * per_token * layers,
        storage_dir=str(tmp_path),
        block_tokens=BLOCK,
        io_threads=2,
    )


def test_offload_logits_equal_dense_bit_for_bit(tiny_llama, tmp_path):
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(1))
    dense, dense_cache = _run(tiny_llama, KVConfig(), ids, steps=20)
    offload, cache = _run(tiny_llama, _offload_config(tmp_path, tiny_llama), ids, steps=20)
    try:
        assert torch.equal(dense, offload)
        assert cache.store.file.io.stats.bytes_read > 0
    finally:
        cache.close()


def test_tokens_spill_in_whole_blocks_oldest_first(tiny_llama, tmp_path):
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(2))
    _, cache = _run(tiny_llama, _offload_config(tmp_path, tiny_llama), ids, steps=5)
    try:
        for layer in cache.layers:
            tiers = layer.tier_tokens()
            assert sum(tiers.values()) == 155
            assert tiers["device"] <= BLOCK and tiers["host"] <= 2 * BLOCK
            assert tiers["host"] % BLOCK == 0 and tiers["storage"] % BLOCK == 0
            assert tiers["storage"] == 155 - tiers["host"] - tiers["device"] > 0
        sizes = tier_bytes(cache, tiny_llama)
        assert sizes["storage"] > sizes["host"] > 0
    finally:
        cache.close()


def test_batch_of_two_matches_dense(tiny_llama, tmp_path):
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(3))
    dense, _ = _run(tiny_llama, KVConfig(), ids, steps=8)
    offload, cache = _run(tiny_llama, _offload_config(tmp_path, tiny_llama, batch=2), ids, steps=8)
    cache.close()
    assert torch.equal(dense, offload)


def test_close_removes_the_kv_file(tiny_llama, tmp_path):
    _, cache = _run(tiny_llama, _offload_config(tmp_path, tiny_llama), torch.zeros(1, 80, dtype=torch.long), steps=1)
    assert list(tmp_path.iterdir())
    cache.close()
    assert not list(tmp_path.iterdir())


def test_sliding_window_layers_stay_dense_on_device(tiny_gemma3, tmp_path):
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(4))
    dense, _ = _run(tiny_gemma3, KVConfig(), ids, steps=6)
    config = _offload_config(tmp_path, tiny_gemma3)
    offload, cache = _run(tiny_gemma3, config, ids, steps=6)
    try:
        kinds = [isinstance(layer, OffloadLayer) for layer in cache.layers]
        assert kinds == [False, True, False, True]
        assert torch.allclose(dense, offload, atol=0, rtol=0)
    finally:
        cache.close()
