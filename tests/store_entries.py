"""Random K/V in a chunked prefill's order, and the meta of a store entry for them (tests/store)."""

import torch

from kvtier.store.meta import EntryMeta

LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 16, 32


def new_meta(dtype: str = "float32") -> EntryMeta:
    return EntryMeta({"model_id": "tiny"}, "digest", "document", BLOCK, [], [[0, 0]] * LAYERS, dtype, [], "head", 0.0)


def prefill_updates(tokens: int, chunk: int, dtype=torch.float32, seed: int = 0):
    """(layer, K, V) in a chunked prefill's order, and each layer's whole K/V."""
    generator = torch.Generator().manual_seed(seed)
    whole = [(torch.randn(1, HEADS, tokens, HEAD_DIM, generator=generator).to(dtype),
              torch.randn(1, HEADS, tokens, HEAD_DIM, generator=generator).to(dtype)) for _ in range(LAYERS)]
    updates = [(layer, keys[:, :, start : start + chunk], values[:, :, start : start + chunk])
               for start in range(0, tokens, chunk) for layer, (keys, values) in enumerate(whole)]
    return updates, whole
