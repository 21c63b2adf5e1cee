"""The sparse path with the model and device window on a GPU: hot pool pinned in host DRAM, chosen hot
tokens copied to the device, the scorer process as on CPU.

Skipped, with the reason shown, where there is no CUDA device (CI is CPU-only); the gathered-hot path's
arithmetic is checked on every machine in test_selection.py.
"""

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the sparse path's CUDA flow needs a GPU", allow_module_level=True)

from tiny_models import tiny_llama  # noqa: E402

from kvtier.kv.model_geometry import full_attention_layers  # noqa: E402
from kvtier.modes import KVConfig, make_cache  # noqa: E402
from kvtier.sparse.cache import make_sparse_cache  # noqa: E402
from kvtier.sparse.settings import SparseSettings  # noqa: E402

pytestmark = pytest.mark.gpu


def _logits(model, cache, ids, steps):
    outputs = []
    with torch.inference_mode():
        outputs.append(model(input_ids=ids, cache=cache).logits[:, -1])
        for _ in range(steps):
            outputs.append(model(input_ids=outputs[-1].argmax(-1, keepdim=True), cache=cache).logits[:, -1])
    return torch.stack(outputs)


def _sparse_cache(model, tmp_path, **settings):
    settings = SparseSettings(beta=0.5, sink=4, recent=16, demote_batch=16, **settings)
    return make_sparse_cache(model, settings, 220, 2, str(tmp_path), device_budget=2**20, host_budget=64 * 1024,
                             tiered_layers=full_attention_layers(model.config))


def _prompt(seed):
    return torch.randint(0, 128, (2, 200), generator=torch.Generator().manual_seed(seed)).to("cuda")


def _dense_logits(model, ids):
    return _logits(model, make_cache(model, KVConfig(), 220, 2), ids, 6)


@pytest.mark.parametrize("alpha", [1.0, 0.3])
def test_sparse_decode_on_cuda_matches_dense_at_alpha_one_and_runs_below(tmp_path, alpha):
    model, ids = tiny_llama().to("cuda"), _prompt(1)
    cache = _sparse_cache(model, tmp_path, alpha=alpha)
    try:
        sparse = _logits(model, cache, ids, 6)
        layer = cache.layers[0]
        keys = layer.hot.key_tiles
        assert layer.keys.device.type == "cuda" and keys.device.type == "cpu" and keys.is_pinned()
        assert all(t["storage"] > 0 for t in (layer.tier_tokens() for layer in cache.layers))
        assert cache.runtime.scorer.host_scored_requests == 0
    finally:
        cache.close()
    if alpha == 1.0:
        dense = _dense_logits(model, ids)
        torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-4)
        assert np.array_equal(sparse.argmax(-1).cpu().numpy(), dense.argmax(-1).cpu().numpy())


@pytest.mark.parametrize("aggregation", ["sum", "max"])  # the folded projection's query, the model's own
def test_the_lookahead_predicts_queries_on_cuda(tmp_path, aggregation):
    """The predicted query is made where the model lies and handed to the scorer from host memory."""
    model, ids = tiny_llama().to("cuda"), _prompt(2)
    cache = _sparse_cache(model, tmp_path, alpha=1.0, aggregation=aggregation, lookahead_skip=1, lookahead_min_cold=1)
    try:
        sparse = _logits(model, cache, ids, 6)
        assert all(step.lookahead_layers > 0 for step in cache.stats.steps[1:])
    finally:
        cache.close()
    torch.testing.assert_close(sparse, _dense_logits(model, ids), rtol=1e-4, atol=1e-4)
