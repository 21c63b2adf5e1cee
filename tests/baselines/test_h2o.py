"""H2O-like: accumulated attention picks the heavy hitters; every step reads all K blocks and the chosen V blocks."""

import numpy as np

from baseline_runs import BLOCK_BYTES, config, greedy, ids, run_watched
from kvtier.baselines import h2o
from kvtier.baselines.h2o import HeavyHitters
from kvtier.modes import make_cache


def test_the_largest_accumulated_mass_wins_over_the_latest_step():
    hitters = HeavyHitters(batch=1, max_tokens=8)
    hitters.add(np.array([[0.0, 0.9, 0.05, 0.05]]))  # token 1 dominates once ...
    hitters.add(np.array([[0.0, 0.0, 0.5, 0.1, 0.4]]))
    hitters.add(np.array([[0.0, 0.0, 0.3, 0.6, 0.1]]))  # ... token 3 wins the latest step
    # accumulated over tokens 1..4: 0.9, 0.85, 0.75, 0.5
    assert hitters.top(first=1, count=4, k=1).tolist() == [[0]]
    assert hitters.top(first=1, count=4, k=2).tolist() == [[0, 1]]


def _prompt_mass(model, tmp_path, prompt, chunk):
    batch, tokens = prompt.shape
    cache = make_cache(model, config("h2o", tmp_path, model, tokens, batch=batch), tokens, batch)
    try:
        greedy(model, cache, prompt, steps=0, chunk=chunk)
        return [layer.hitters.mass.copy() for layer in cache.layers]
    finally:
        cache.close()


def test_the_prompt_mass_is_every_prompt_querys_attention(tiny_llama, tmp_path, monkeypatch):
    prompt = ids(2, 120, 8)
    whole = _prompt_mass(tiny_llama, tmp_path, prompt, chunk=120)
    monkeypatch.setattr(h2o, "QUERY_SLICE", 7)  # slicing the queries of a chunk changes nothing
    chunked = _prompt_mass(tiny_llama, tmp_path, prompt, chunk=50)
    for mass, other in zip(whole, chunked):
        np.testing.assert_allclose(mass, other, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(mass.sum(axis=1), 4 * 120, rtol=1e-5)  # each of 4 heads x 120 queries sums to 1
        assert (mass[:, 120:] == 0).all()


def test_every_step_reads_all_key_blocks_and_only_the_chosen_values_pages(tiny_llama, tmp_path):
    prompt, batch = ids(2, 250, 9), 2
    _, seen, read, cache = run_watched(tiny_llama, config("h2o", tmp_path, tiny_llama, 254, batch=batch), prompt, 4)
    key_blocks = sum(batch * step.stored_tokens // 32 for step in seen)
    value_bytes = sum(step.disk_bytes for step in seen)  # the file's pages holding the chosen tokens' values
    next_step_prefetch = batch * cache.layers[0].stored_tokens // 32  # the last step prefetched layer 0's keys
    assert read == (key_blocks + next_step_prefetch) * BLOCK_BYTES + value_bytes
    assert 0 < value_bytes < key_blocks * BLOCK_BYTES
