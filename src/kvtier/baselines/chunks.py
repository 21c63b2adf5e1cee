"""Chunks of a layer's pool ranked by a bound on their keys: LeoAM's variable-size chunks, and the layer that
attends whole chunks (LeoAM's, and Quest's fixed pages in quest.py).

A chunk is a run of consecutive pool tokens; its *abstract* is the per-channel
minimum and maximum of its keys ([H, D] each). For a query q,
sum_d max(q_d min_d, q_d max_d) bounds q.k from above for every key k of the
chunk (Quest's bound), so chunks can be ranked without reading their keys.
`ChunkLayer` takes the best chunks until they hold the step's share, reads
their K/V and cuts the last one to the tokens still needed by exact q.k, so
every mode attends the same number of tokens.

Chunk boundaries (the rule, and what it simplifies):
- Chunks never cross a disk block, so loading a chunk reads exactly the block
  (or blocks of several chunks) that holds it.
- Prompt: each block-sized region of the pool is one chunk unless its tokens
  are at least twice as important as the pool's average (observation-window
  importance, kvtier.sparse.hot.initial_placement); such a region is halved, recursively,
  down to `min_chunk` tokens. Low-importance regions thus stay in large chunks and the
  important ones get fine chunks, where precise selection pays. LeoAM varies
  chunk sizes with the skew of attention; this per-region rule is our reading
  of it. A split happens when *any* sequence of the batch finds the region
  important, so all sequences share boundaries (rectangular abstract tables)
  and no sequence gets coarser chunks than it alone would.
- Tokens generated after the prompt are recent, hence likely attended: they
  form chunks of `min_chunk` tokens (cut at block ends).
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch

from kvtier.baselines.selective import Selected, SelectiveLayer
from kvtier.storage import K, V

SPLIT_DENSITY = 2.0  # a region is split when its mean importance is at least this many times the pool's mean


def chunk_ends(importance: np.ndarray, block_tokens: int, min_chunk: int) -> list[int]:
    """Ends (exclusive pool indices, ascending) of the chunks of a prompt pool with importance [B, P]."""
    pool = importance.shape[1]
    density = importance / np.maximum(importance.mean(axis=1, keepdims=True), np.finfo(np.float32).tiny)
    ends: list[int] = []

    def split(start: int, end: int) -> None:
        if end - start >= 2 * min_chunk and density[:, start:end].mean(axis=1).max() >= SPLIT_DENSITY:
            middle = start + (end - start) // 2
            split(start, middle)
            split(middle, end)
        else:
            ends.append(end)

    for start in range(0, pool, block_tokens):
        split(start, min(start + block_tokens, pool))
    return ends


def upper_bounds(query: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> torch.Tensor:
    """Bound [B, C] of sum over heads of q.k, for query [B, H, D] and chunk abstracts [B, H, C, D]."""
    q = query[:, :, None, :]
    return torch.maximum(q * mins.float(), q * maxs.float()).sum(dim=(1, 3))


def key_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Exact sum over heads of q.k [B, N] for query [B, H, D] and keys [B, H, N, D] (what the bound bounds)."""
    return (query[:, :, None, :] * keys.float()).sum(dim=(1, 3))


def cover(bounds: np.ndarray, sizes: np.ndarray, tokens: int) -> list[np.ndarray]:
    """Per sequence the chunks with the highest bounds [B, C], best first, until they hold `tokens` tokens."""
    chosen = []
    for row in bounds:
        order = np.argsort(-row, kind="stable")
        covered = np.cumsum(sizes[order])
        chosen.append(order[: int(np.searchsorted(covered, tokens)) + 1] if tokens else order[:0])
    return chosen


class ChunkTable:
    """The chunks of one layer's pool (shared by the batch) and the abstracts not yet written to disk.

    Chunks 0..flushed-1 have their abstracts on disk, in whole blocks; the rest
    (at most one block of closed chunks and the chunk still filling) are here.
    """

    def __init__(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, block_tokens: int,
                 min_chunk: int) -> None:
        self.block_tokens, self.min_chunk = block_tokens, min_chunk
        self.starts = np.empty(0, dtype=np.int64)
        self.ends = np.empty(0, dtype=np.int64)  # planned ends; the last chunk may not be full yet
        self.filled = 0  # pool tokens in chunks
        self.flushed = 0
        self.mins = torch.empty(batch, heads, 0, head_dim, dtype=dtype)
        self.maxs = torch.empty_like(self.mins)
        self._planned: list[int] = []

    def plan(self, ends: list[int]) -> None:
        """Chunk ends for the tokens about to enter (the prompt pool)."""
        self._planned = list(ends)

    def sizes(self) -> np.ndarray:
        return np.minimum(self.ends, self.filled) - self.starts

    def tokens(self, chunk: int) -> np.ndarray:
        """Pool indices of `chunk`."""
        return np.arange(self.starts[chunk], min(self.ends[chunk], self.filled))

    def add(self, keys: torch.Tensor, first: int) -> None:
        """Keys [B, H, n, D] of pool tokens first..first+n-1 join their chunks (opening chunks as needed)."""
        offset, count = 0, keys.shape[2]
        while offset < count:
            index = first + offset
            if not len(self.ends) or self.ends[-1] <= index:
                self._open(index)
            take = min(int(self.ends[-1]) - index, count - offset)
            piece = keys[:, :, offset : offset + take]
            self.mins[:, :, -1] = torch.minimum(self.mins[:, :, -1], piece.amin(dim=2))
            self.maxs[:, :, -1] = torch.maximum(self.maxs[:, :, -1], piece.amax(dim=2))
            offset += take
        self.filled = first + count

    def _open(self, start: int) -> None:
        block_end = (start // self.block_tokens + 1) * self.block_tokens
        end = self._planned.pop(0) if self._planned else min(start + self.min_chunk, block_end)
        self.starts, self.ends = np.append(self.starts, start), np.append(self.ends, end)
        shape = (*self.mins.shape[:2], 1, self.mins.shape[3])
        self.mins = torch.cat([self.mins, torch.full(shape, float("inf"), dtype=self.mins.dtype)], dim=2)
        self.maxs = torch.cat([self.maxs, torch.full(shape, float("-inf"), dtype=self.maxs.dtype)], dim=2)

    def take_full_blocks(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Abstracts (mins, maxs) of the closed chunks that fill whole blocks, removed from here; None if none."""
        closed = int(np.count_nonzero(self.ends <= self.filled)) - self.flushed
        count = closed // self.block_tokens * self.block_tokens
        if not count:
            return None
        mins, maxs = self.mins[:, :, :count], self.maxs[:, :, :count]
        self.mins, self.maxs = self.mins[:, :, count:].clone(), self.maxs[:, :, count:].clone()
        self.flushed += count
        return mins, maxs


class ChunkLayer(SelectiveLayer):
    """A tiered layer that attends whole chunks chosen by their bounds, the last chunk cut to what is still needed."""

    @abstractmethod
    def chunk_tokens(self, chunk: int) -> np.ndarray:
        """Pool indices of `chunk`, ascending."""

    def take_chunks(self, summed: torch.Tensor, chosen: list[np.ndarray]) -> Selected:
        """The tokens of the chunks `chosen` per sequence (best first), read from where they lie, as a Selected.

        `summed`: the query summed over the query heads of each KV head [B, H, D], what the last chunk is cut by.
        """
        candidates = [np.concatenate([self.chunk_tokens(chunk) for chunk in chunks] or [np.empty(0, np.int64)])
                      for chunks in chosen]
        self.runtime.kv.read_tokens(self.layer_idx, candidates, (K, V))
        index = np.stack([self._cut_last(seq, summed, chunks) for seq, chunks in enumerate(chosen)])
        return Selected(index, self.gather(index, K), self.gather(index, V))

    def _cut_last(self, seq: int, summed: torch.Tensor, chunks: np.ndarray) -> np.ndarray:
        """Pool indices attended by sequence `seq`, ascending: every chunk but the last whole, then its best tokens."""
        if not len(chunks):
            return np.empty(0, dtype=np.int64)
        whole = [self.chunk_tokens(chunk) for chunk in chunks[:-1]]
        last = self.chunk_tokens(chunks[-1])
        needed = self.selection_size() - sum(len(tokens) for tokens in whole)
        if needed < len(last):
            scores = key_scores(summed[seq : seq + 1], self.gather(last[None], K, seq=seq))[0]
            last = last[scores.topk(needed).indices.numpy()]
        return np.sort(np.concatenate([*whole, last]))
