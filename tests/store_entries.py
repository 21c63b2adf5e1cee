"""Random K/V in a chunked prefill's order, and the meta of a store entry for them (tests/store)."""

import os
import signal

import torch

from kvtier.docstore.meta import EntryMeta

LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 32, 64  # a record: 64 tokens x 32 x 2-4 bytes, whole 4 KiB pages


def block_names(name: str, blocks: int) -> list[str]:
    return [f"{name}{block:04d}" + "0" * 16 for block in range(blocks)]


def new_meta(blocks: list[str], dtype: str = "float32") -> EntryMeta:
    return EntryMeta({"model_id": "tiny"}, "digest", "document", BLOCK, blocks, [[HEADS, HEAD_DIM]] * LAYERS, dtype,
                     [], "head", 0.0)


def prefill_updates(tokens: int, chunk: int, dtype=torch.float32, seed: int = 0):
    """(layer, K, V) in a chunked prefill's order, and each layer's whole K/V."""
    generator = torch.Generator().manual_seed(seed)
    whole = [(torch.randn(1, HEADS, tokens, HEAD_DIM, generator=generator).to(dtype),
              torch.randn(1, HEADS, tokens, HEAD_DIM, generator=generator).to(dtype)) for _ in range(LAYERS)]
    updates = [(layer, keys[:, :, start : start + chunk], values[:, :, start : start + chunk])
               for start in range(0, tokens, chunk) for layer, (keys, values) in enumerate(whole)]
    return updates, whole


class KilledAt:
    """`os` for the store's modules in a forked writer: SIGKILL itself at the n-th file-changing call."""

    CALLS = ("write", "pwrite", "fsync", "rename", "open", "close", "ftruncate", "copy_file_range")

    def __init__(self, point: int) -> None:
        self.point, self.calls = point, 0

    def __getattr__(self, name):
        real = getattr(os, name)
        if name not in self.CALLS:
            return real

        def counted(*args, **kwargs):
            self.calls += 1
            if self.calls == self.point:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return counted
