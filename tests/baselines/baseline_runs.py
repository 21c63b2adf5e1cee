"""Helpers for the baseline tests: budgets that put most KV on disk, greedy runs, what each step attended."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.kv.model_geometry import full_attention_layers
from kvtier.modes import KVConfig, make_cache
from kvtier.storage import PAGE, KVGeometry
from kvtier.storage.pages import pages_holding

MODES = ("h2o", "infinigen", "leoam", "quest")
TOKEN_BYTES = 128  # K or V of one token and layer in both tiny models
BLOCK = 32  # 32 tokens x 128 bytes = one 4 KiB page
BLOCK_BYTES = 4096
SINK, RECENT = 4, 16


def ids(batch: int, tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def config(kv: str, tmp_path, model, max_tokens: int, alpha: float = 0.2, batch: int = 1,
           host_blocks: int = 1, block: int = BLOCK) -> KVConfig:
    """Device: one block (fits the window); host: the mode's reserve + `host_blocks` blocks a layer; disk: the rest."""
    layers = len(full_attention_layers(model.config))
    block_bytes = block * 2 * TOKEN_BYTES * layers * batch
    return KVConfig(kv=kv, alpha=alpha, sink=SINK, recent=RECENT, block_tokens=block, io_threads=2,
                    device_kv_budget=block_bytes, storage_dir=str(tmp_path),
                    host_kv_budget=host_blocks * block_bytes + reserved(kv, model, max_tokens, batch))


def reserved(kv: str, model, max_tokens: int, batch: int) -> int:
    """Host bytes a mode keeps besides pooled K/V: InfiniGen's partial keys, LeoAM's abstract write buffer, Quest's
    page table."""
    layers = len(full_attention_layers(model.config))
    geometry = KVGeometry.from_config(model.config, "float32")
    if kv == "infinigen":
        channels = math.ceil(0.3 * geometry.head_dim)
        return layers * batch * max_tokens * geometry.num_kv_heads * channels * 4
    if kv == "leoam":
        return BLOCK * 2 * 128 * layers * batch
    if kv == "quest":
        return layers * batch * -(-max_tokens // 16) * 2 * 128  # a min and a max key (128 bytes each) per page
    return 0


def greedy(model, cache, prompt: torch.Tensor, steps: int, chunk: int = 64) -> torch.Tensor:
    """Chunked prefill then greedy steps; the logits of every forward pass, stacked."""
    outputs = []
    with torch.inference_mode():
        for start in range(0, prompt.shape[1], chunk):
            outputs.append(model(input_ids=prompt[:, start : start + chunk], cache=cache).logits[:, -1])
        for _ in range(steps):
            outputs.append(model(input_ids=outputs[-1].argmax(-1, keepdim=True), cache=cache).logits[:, -1])
    return torch.stack(outputs)


def dense(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    return greedy(model, make_cache(model, KVConfig(), prompt.shape[1] + steps, prompt.shape[0]), prompt, steps)


@dataclass
class Attended:
    """One layer's decode step as the watch callback saw it (before the step's token retired into the pool)."""

    layer: int
    positions: np.ndarray  # [B, n]
    tokens: int  # tokens of the layer, the new one included
    stored_tokens: int  # pool tokens on disk
    disk_blocks: int  # disk blocks holding attended tokens, summed over sequences
    disk_bytes: int  # bytes of the file's pages (read units) holding them (gaps of one bridged), summed over sequences
    extra: object = None  # what `watch(..., also=)` read off the layer


def watch(cache, also: Callable | None = None) -> list[Attended]:
    """Record every decode step of every tiered layer of `cache` (and `also(layer)`, if given)."""
    seen: list[Attended] = []

    def record(layer_idx: int, positions: np.ndarray) -> None:
        layer = cache.layers[layer_idx]
        pool, block = positions - layer.sink_tokens, layer.runtime.capacity.block_tokens
        on_disk = [np.unique(row[(row >= 0) & (row < layer.stored_tokens)]) for row in pool]
        blocks = sum(len(np.unique(tokens // block)) for tokens in on_disk)
        file = layer.runtime.kv.file
        page = file.page_bytes if file.page_checksums else PAGE  # (disk_bytes is not read then: blocks are)
        nbytes = sum(len(pages_holding(tokens, TOKEN_BYTES, page=page)) * page for tokens in on_disk)
        seen.append(Attended(layer_idx, positions.copy(), layer.tokens, layer.stored_tokens, blocks, nbytes,
                             also(layer) if also else None))

    cache.watch_attended(record)
    return seen


def run_watched(model, kv_config: KVConfig, prompt: torch.Tensor, steps: int):
    """(logits, attended steps, bytes read incl. prefetches finished at close, cache) of a closed cache."""
    cache = make_cache(model, kv_config, prompt.shape[1] + steps, prompt.shape[0])
    seen = watch(cache)
    try:
        logits = greedy(model, cache, prompt, steps)
    finally:
        cache.close()
    return logits, seen, cache.io_stats().bytes_read, cache


def attended_count(tokens: int, alpha: float) -> int:
    """sink + ceil(alpha x pooled) + recent window: what every mode attends (as --kv sparse)."""
    return SINK + int(np.ceil(alpha * (tokens - SINK - RECENT))) + RECENT
