"""InfiniGen-like: partial channels rank the important token, speculation from the previous layer, reads of the chosen."""

import pytest
import torch

from baseline_runs import BLOCK_BYTES, config, greedy, ids, run_watched
from kvtier.baselines import selective_runtime
from kvtier.baselines.infinigen import approximate_scores, choose_channels, speculative_query, take_channels
from kvtier.modes import make_cache
from kvtier.storage import PAGE


def test_partial_channels_rank_the_planted_token_first():
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 1, 1, 8, generator=generator) * 0.01
    query[..., 2], query[..., 5] = 2.0, -3.0
    keys = torch.randn(1, 1, 10, 8, generator=generator) * 0.1
    keys[0, 0, 7, 2], keys[0, 0, 7, 5] = 1.0, -1.0  # planted: aligned with the query where it is large
    keys[0, 0, 3, 0] = 10.0  # a decoy: large where the query is ~0
    key_magnitude = keys[0].abs().sum(dim=1)
    assert choose_channels(torch.ones_like(key_magnitude), key_magnitude, count=2).tolist() == [[0, 5]]
    channels = choose_channels(query[0, :, 0].abs(), key_magnitude, count=2)
    assert channels.tolist() == [[2, 5]]
    scores = approximate_scores(take_channels(query, channels), take_channels(keys, channels), scaling=1.0)
    assert scores.argmax().item() == 7


@pytest.mark.parametrize("model_name, layer", [("tiny_llama", 1), ("tiny_gemma3", 1)])
def test_the_speculative_query_from_a_layers_own_input_is_its_query(request, tmp_path, model_name, layer):
    model = request.getfixturevalue(model_name)
    cache = make_cache(model, config("infinigen", tmp_path, model, 60, 1.0), 60)
    inputs, queries = [], []
    tiered = cache.layers[layer]
    select = tiered.select
    tiered.select = lambda query, scaling: queries.append(query) or select(query, scaling)
    hook = model.model.layers[layer].register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    try:
        greedy(model, cache, ids(1, 50, 1), steps=3)
    finally:
        hook.remove()
        cache.close()
    for step, query in enumerate(queries):  # one prefill pass, then the 3 decode passes
        speculated = speculative_query(model, layer, inputs[-3 + step], 50 + step)
        torch.testing.assert_close(speculated, query, rtol=1e-5, atol=1e-5)


def test_speculation_runs_before_the_previous_layer_and_hooks_go_with_the_cache(tiny_llama, tmp_path):
    cache = make_cache(tiny_llama, config("infinigen", tmp_path, tiny_llama, 110, 0.25), 110)
    ahead = []
    cache.watch_attended(lambda layer, positions: ahead.append(layer == 0 and cache.layers[1].speculated is not None))
    decoder = tiny_llama.model.layers
    try:
        assert len(decoder[0]._forward_pre_hooks) == 1 and not decoder[1]._forward_pre_hooks  # layer 0 has no previous
        greedy(tiny_llama, cache, ids(1, 100, 2), steps=4)
    finally:
        cache.close()
    assert ahead[::2] == [True] * 4  # layer 1's selection was submitted when layer 0 attended
    assert not decoder[0]._forward_pre_hooks


def test_only_the_chosen_tokens_pages_are_read(tiny_llama, tmp_path):
    prompt = ids(2, 250, 3)
    kv_config = config("infinigen", tmp_path, tiny_llama, 254, alpha=0.02, batch=2)  # few tokens: few pages
    _, seen, read, _ = run_watched(tiny_llama, kv_config, prompt, 4)
    chosen_bytes = sum(step.disk_bytes for step in seen)
    all_bytes = sum(2 * step.stored_tokens * 128 for step in seen)
    assert read == 2 * chosen_bytes  # K and V of each page holding a chosen token (or bridging), nothing else
    assert 0 < chosen_bytes < all_bytes


def test_page_reads_of_multi_page_blocks_read_less_and_give_the_same_logits(tiny_llama, tmp_path, monkeypatch):
    prompt = ids(1, 250, 5)
    kv_config = config("infinigen", tmp_path, tiny_llama, 254, alpha=0.05, block=128)  # blocks of 4 pages
    logits, seen, read, _ = run_watched(tiny_llama, kv_config, prompt, 4)
    monkeypatch.setattr(selective_runtime, "pages_fill_blocks", lambda geometry, block_tokens: False)  # whole blocks instead
    block_logits, _, block_read, _ = run_watched(tiny_llama, kv_config, prompt, 4)
    assert torch.equal(logits, block_logits)
    nbytes, blocks = sum(step.disk_bytes for step in seen), sum(step.disk_blocks for step in seen)
    assert read == 2 * nbytes and block_read == 2 * blocks * 4 * PAGE and read < block_read
