"""`--kv quest`: a page-level query-aware baseline after Quest ("Quest: Query-Aware Sparsity for Efficient
Long-Context LLM Inference", Tang et al., ICML 2024).

Quest splits the KV cache into pages of 16 tokens and keeps, per page, the
per-channel minimum and maximum of its keys. Each decode step it bounds every
page's q.k from above without reading the page, sum_d max(q_d min_d, q_d max_d),
and attends exactly over the tokens of the pages with the highest bounds. Here:

- Pages are 16 consecutive pool tokens (pool index i is in page i // 16); the
  page table (mins and maxs, the model dtype) is preallocated for `max_tokens`
  and kept in host DRAM, charged to the host budget like InfiniGen's partial key
  cache (Quest keeps it in GPU memory; on these tiers the device holds only the
  window). A token updates its page's mins and maxs when it joins the pool.
- Each step and tiered layer, each query head's bound is computed for every
  page and summed over the query heads (Quest ranks per head; every mode here
  attends one set of tokens per layer); pages are taken best first until they
  hold the top-alpha share of the pool, their K and V pages on disk are read
  (host DRAM holds the newest), and the last page is cut to the tokens still
  needed by exact q.k (chunks.ChunkLayer, shared with LeoAM): every mode attends
  the same number of tokens.
- Unlike LeoAM, nothing about the choice is on disk: no reads to choose, only
  reads of what was chosen.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.baselines.chunks import ChunkLayer, cover, upper_bounds
from kvtier.baselines.selective import Selected, SelectiveCache, build_cache, grouped_query
from kvtier.baselines.selective_runtime import SelectiveRuntime, TierSetup
from kvtier.kv.model_geometry import model_geometry

PAGE_TOKENS = 16  # Quest's page size


class PageTable:
    """Per-channel key min and max [B, H, pages, D] of each page of `page_tokens` consecutive pool tokens."""

    def __init__(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, max_tokens: int,
                 page_tokens: int = PAGE_TOKENS) -> None:
        pages = -(-max_tokens // page_tokens)
        self.page_tokens = page_tokens
        self.mins = torch.full((batch, heads, pages, head_dim), float("inf"), dtype=dtype)
        self.maxs = torch.full((batch, heads, pages, head_dim), float("-inf"), dtype=dtype)
        self.filled = 0  # pool tokens counted in the table

    @property
    def pages(self) -> int:
        return -(-self.filled // self.page_tokens)

    def add(self, keys: torch.Tensor, first: int) -> None:
        """Keys [B, H, n, D] of pool tokens first..first+n-1, the next ones in pool order, join their pages."""
        if first != self.filled:
            raise ValueError(f"pool tokens join in order: expected index {self.filled}, got {first}")
        count = keys.shape[2]
        page = torch.arange(first, first + count) // self.page_tokens
        index = page[None, None, :, None].expand_as(keys)
        self.mins.scatter_reduce_(2, index, keys.to(self.mins.dtype), "amin")
        self.maxs.scatter_reduce_(2, index, keys.to(self.maxs.dtype), "amax")
        self.filled = first + count

    def sizes(self) -> np.ndarray:
        """Tokens in each page so far [pages] (only the last may be short)."""
        sizes = np.full(self.pages, self.page_tokens, dtype=np.int64)
        if self.pages:
            sizes[-1] = self.filled - (self.pages - 1) * self.page_tokens
        return sizes

    def tokens(self, page: int) -> np.ndarray:
        """Pool indices of `page`."""
        return np.arange(page * self.page_tokens, min((page + 1) * self.page_tokens, self.filled))

    def bounds(self, grouped: torch.Tensor) -> torch.Tensor:
        """Quest's bound [B, pages] for a grouped query [B, H, G, D]: each query head's bound, summed over heads."""
        batch, heads, group, head_dim = grouped.shape
        used = slice(0, self.pages)
        mins = self.mins[:, :, used].repeat_interleave(group, dim=1)  # one row of abstracts per query head
        maxs = self.maxs[:, :, used].repeat_interleave(group, dim=1)
        return upper_bounds(grouped.reshape(batch, heads * group, head_dim), mins, maxs)


class QuestLayer(ChunkLayer):
    """A tiered layer choosing whole 16-token pages by the bound of their in-memory key mins and maxs."""

    def __init__(self, layer_idx: int, runtime: SelectiveRuntime, page_tokens: int) -> None:
        super().__init__(layer_idx, runtime)
        self.page_tokens = page_tokens
        self.pages: PageTable | None = None

    def make_pool(self, batch: int, heads: int, head_dim: int) -> None:
        super().make_pool(batch, heads, head_dim)
        self.pages = PageTable(batch, heads, head_dim, self.dtype, self.runtime.setup.max_tokens, self.page_tokens)

    def on_admit(self, keys: torch.Tensor, first: int) -> None:
        self.pages.add(keys, first)

    def chunk_tokens(self, chunk: int) -> np.ndarray:
        return self.pages.tokens(chunk)

    def select(self, query: torch.Tensor, scaling: float) -> Selected:
        grouped = grouped_query(query, self.pages.mins.shape[1])
        chosen = cover(self.pages.bounds(grouped).numpy(), self.pages.sizes(), self.selection_size())
        return self.take_chunks(grouped.sum(dim=2), chosen)


def page_table_bytes(model, setup: TierSetup, page_tokens: int = PAGE_TOKENS) -> int:
    """Host bytes of the page tables of every tiered layer and sequence, for `setup.max_tokens` tokens."""
    geometry = model_geometry(model, setup.tiered_layers)
    pages = -(-setup.max_tokens // page_tokens)
    return (geometry.num_layers * setup.batch_size * pages * 2 * geometry.num_kv_heads * geometry.head_dim
            * geometry.itemsize)


def make_quest_cache(model, setup: TierSetup, page_tokens: int = PAGE_TOKENS) -> SelectiveCache:
    """The `--kv quest` cache: same tiers, budgets and block file as the other modes; the page tables are charged to
    the host budget."""

    def make_layer(layer_idx: int, runtime: SelectiveRuntime) -> QuestLayer:
        return QuestLayer(layer_idx, runtime, page_tokens)

    reserved_for = f"Quest's page table (key min and max per {page_tokens}-token page)"
    return build_cache(model, setup, make_layer, page_table_bytes(model, setup, page_tokens), reserved_for)
