"""The shared timing loop: step counts, medians, disk bytes per step, the progress bar. No speed is asserted."""

import torch

from kvtier.eval.sparse.decode_timing import measure_decode
from kvtier.kv.dense import DenseCache
from kvtier.modes import KVConfig, make_cache
from kvtier.sparse.threads import torch_threads


def test_times_every_step_and_counts_disk_bytes(tiny_llm, tmp_path, capsys):
    model = tiny_llm.model
    ids = torch.randint(0, model.config.vocab_size, (2, 300))
    config = KVConfig(kv="offload", device_kv_budget="64KiB", host_kv_budget=0, storage_dir=str(tmp_path), block_tokens=16)
    cache = make_cache(model, config, 300 + 6, batch_size=2)
    try:
        measured = measure_decode(model, cache, ids, new_tokens=4, prefill_chunk=128, warmup_steps=1, label="offload")
    finally:
        cache.close()
    steps = measured["step_ms"]
    assert len(steps) == 4 and min(steps) <= measured["median_step_ms"] <= max(steps)
    assert abs(measured["ms_per_token"] - sum(steps) / 4) < 1e-6
    assert len(measured["token_ids"]) == 2 and len(measured["token_ids"][0]) == 1 + 4  # warm-up + timed steps
    assert measured["disk_read_bytes_per_step"] > 0  # every offload step reads the whole stored KV
    assert "offload" in capsys.readouterr().err  # the progress bar names the run


class _ThreadSpy(DenseCache):
    """A dense cache that notes torch's thread count at every forward pass (prompt chunks and steps)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.threads = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            self.threads.append((key_states.shape[2], torch.get_num_threads()))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def test_decode_threads_apply_to_the_steps_only_and_are_restored(tiny_llm, monkeypatch):
    monkeypatch.setattr("kvtier.sparse.threads.decode_threads", lambda mode: 1)  # a mode decoding on 1 thread of 2
    model = tiny_llm.model
    with torch_threads(2):
        cache = _ThreadSpy(model.config)
        measure_decode(model, cache, torch.randint(0, model.config.vocab_size, (1, 40)), new_tokens=2,
                       prefill_chunk=32, decode_mode="offload")
        assert cache.threads == [(32, 2), (8, 2), (1, 1), (1, 1), (1, 1)]  # two prompt chunks, warm-up, 2 steps
        assert torch.get_num_threads() == 2
