"""The sparse attention hand-off: tiered layers' decode steps go to SparseLayer.attend, on one torch thread."""

import torch

from kvtier.kv.model_geometry import full_attention_layers
from kvtier.sparse.cache import make_sparse_cache
from kvtier.sparse.layer import SparseLayer
from kvtier.sparse.settings import SparseSettings
from kvtier.sparse.threads import torch_threads


def test_a_tiered_layers_decode_step_runs_on_one_torch_thread(tiny_llama, tmp_path, monkeypatch):
    seen = []
    attend = SparseLayer.attend

    def counting_attend(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(SparseLayer, "attend", counting_attend)
    settings = SparseSettings(beta=0.5, sink=4, recent=16, demote_batch=16, alpha=0.1)
    cache = make_sparse_cache(tiny_llama, settings, 420, 1, str(tmp_path), device_budget=2**20,
                              host_budget=64 * 1024, tiered_layers=full_attention_layers(tiny_llama.config))
    ids = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(3))
    try:
        with torch_threads(2), torch.inference_mode():
            logits = tiny_llama(input_ids=ids, cache=cache).logits[:, -1]
            tiny_llama(input_ids=logits.argmax(-1, keepdim=True), cache=cache)
            assert torch.get_num_threads() == 2  # the rest of the model keeps its threads
    finally:
        cache.close()
    assert seen and set(seen) == {1}
