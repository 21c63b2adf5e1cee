"""`--kv leoam`: the paper's "LeoAM-like" baseline (LeoAM, Sun et al. 2025, "sun2025breaking").

LeoAM splits the KV into variable-size chunks, keeps a small *abstract* of
each chunk's keys on disk next to the KV, and per step reads only the
abstracts to decide which chunks to load. Here (chunk rule in chunks.py):

- Abstracts (per-channel key min and max of a chunk) live in a second block
  file in the storage dir, same block size and I/O engine as the KV file: the
  K region holds the minimums, the V region the maximums, one row per chunk.
  Closed chunks are written in whole blocks; the last block's worth (closed
  chunks not yet filling a block, and the chunk still filling) waits in DRAM,
  charged to the host budget as one block per layer.
- Every decode step each tiered layer reads all its abstract blocks (prefetched
  while the previous tiered layer computes: they do not depend on the query),
  ranks chunks by the Quest-style upper bound of q.k (query heads of a KV head
  summed, as in the sparse path), takes chunks best first until they hold the
  top-alpha share of the pool, and reads the K and V pages of those chunks
  that are on disk.
- Every chunk taken is attended whole except the last, which is cut to the
  tokens still needed by their exact q.k (its keys are loaded anyway), so every
  mode attends the same number of tokens per step. LeoAM's dynamic compression
  and its GPU/CPU/disk pipeline are left out: all modes here store KV
  uncompressed and share one I/O engine.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvtier.baselines.prompt_attention import attention_mass
from kvtier.baselines.chunks import ChunkLayer, ChunkTable, chunk_ends, cover, upper_bounds
from kvtier.baselines.selective_runtime import SelectiveRuntime, TierSetup
from kvtier.baselines.selective import Selected, SelectiveCache, build_cache, grouped_query
from kvtier.baselines.selective_store import SelectiveStore
from kvtier.kv.model_geometry import model_geometry
from kvtier.storage import K, V

ABSTRACTS = "leoam-abstracts"


class LeoAMLayer(ChunkLayer):
    """A tiered layer choosing whole chunks by their on-disk key abstracts."""

    def __init__(self, layer_idx: int, runtime: SelectiveRuntime, min_chunk: int) -> None:
        super().__init__(layer_idx, runtime)
        self.min_chunk = min_chunk
        self.abstracts: SelectiveStore = runtime.extra[ABSTRACTS]
        self.table: ChunkTable | None = None
        self._window: torch.Tensor | None = None  # last prompt queries, for the chunk boundaries
        self._scaling = 1.0

    def observe(self, query: torch.Tensor, scaling: float) -> None:
        recent = query if self._window is None else torch.cat([self._window, query], dim=2)
        self._window = recent[:, :, -self.runtime.settings.observation_window :].clone()
        self._scaling = scaling

    def prepare(self, pool_keys: torch.Tensor) -> None:
        """Chunk the prompt pool by its observation-window importance."""
        batch, heads, count, head_dim = pool_keys.shape
        importance = attention_mass(self._window, self.keys, self._scaling)
        pool_importance = importance[:, self.sink_tokens : self.sink_tokens + count].cpu().numpy()
        block = self.runtime.capacity.block_tokens
        self.table = ChunkTable(batch, heads, head_dim, self.dtype, block, self.min_chunk)
        self.table.plan(chunk_ends(pool_importance, block, self.min_chunk))
        self._window = None

    def on_admit(self, keys: torch.Tensor, first: int) -> None:
        self.table.add(keys, first)
        full = self.table.take_full_blocks()
        if full is not None:
            self.abstracts.append(self.layer_idx, *full)

    def whole_reads(self) -> tuple[SelectiveStore, tuple[int, ...]]:
        return self.abstracts, (K, V)

    def chunk_tokens(self, chunk: int) -> np.ndarray:
        return self.table.tokens(chunk)

    def select(self, query: torch.Tensor, scaling: float) -> Selected:
        self.load_whole()
        on_disk = slice(0, self.table.flushed)
        mins = torch.cat([self.abstracts.tokens(K)[:, on_disk].permute(0, 2, 1, 3), self.table.mins], dim=2)
        maxs = torch.cat([self.abstracts.tokens(V)[:, on_disk].permute(0, 2, 1, 3), self.table.maxs], dim=2)
        summed = grouped_query(query, mins.shape[1]).sum(dim=2)
        chosen = cover(upper_bounds(summed, mins, maxs).numpy(), self.table.sizes(), self.selection_size())
        return self.take_chunks(summed, chosen)


def make_leoam_cache(model, setup: TierSetup, min_chunk: int | None = None) -> SelectiveCache:
    """The `--kv leoam` cache; `min_chunk` (default block_tokens / 8) is the finest chunk size."""
    block = setup.block_tokens
    min_chunk = min_chunk or max(1, block // 8)
    # chunks never cross blocks; per block at most block/min_chunk of them, plus two cut short (prompt end, block end)
    max_chunks = (math.ceil(setup.max_tokens / block) + 1) * (math.ceil(block / min_chunk) + 2)
    geometry = model_geometry(model, setup.tiered_layers)
    write_buffer = geometry.token_bytes * block * setup.batch_size

    def make_layer(layer_idx: int, runtime: SelectiveRuntime) -> LeoAMLayer:
        return LeoAMLayer(layer_idx, runtime, min_chunk)

    return build_cache(model, setup, make_layer, write_buffer, "LeoAM's abstract write buffer of one block per layer",
                       extra_stores={ABSTRACTS: max_chunks})
