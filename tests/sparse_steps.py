"""Small sparse caches on tiny models and greedy runs through them, for the sparse path's tests."""

import torch

from kvtier.kv.model_geometry import full_attention_layers
from kvtier.sparse.cache import make_sparse_cache
from kvtier.sparse.settings import SparseSettings


def run(model, cache, ids, steps, chunk=64, between_steps=None):
    """Chunked prefill then greedy steps; logits of every forward pass, stacked."""
    outputs = []
    with torch.inference_mode():
        for start in range(0, ids.shape[1], chunk):
            outputs.append(model(input_ids=ids[:, start : start + chunk], cache=cache).logits[:, -1])
        for step in range(steps):
            if between_steps is not None:
                between_steps(step, cache)
            token = outputs[-1].argmax(-1, keepdim=True)
            outputs.append(model(input_ids=token, cache=cache).logits[:, -1])
    return torch.stack(outputs)


def ids(batch, tokens, seed):
    """Random token ids [batch, tokens] from a seeded generator."""
    return torch.randint(0, 128, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def sparse_cache(model, tmp_path, tokens, batch=1, host="64KiB", **settings):
    """A sparse cache of `tokens` per sequence in `tmp_path`, a small window, `host` KiB of hot pool, 1 MiB device."""
    settings = SparseSettings(**{"beta": 0.5, "sink": 4, "recent": 16, "demote_batch": 16, **settings})
    config = model.config
    return make_sparse_cache(model, settings, tokens, batch, str(tmp_path), device_budget=2**20,
                             host_budget=int(host.removesuffix("KiB")) * 1024, tiered_layers=full_attention_layers(config))
