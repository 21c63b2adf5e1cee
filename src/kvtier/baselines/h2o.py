"""`--kv h2o`: the paper's "H2O-like" host-centric baseline (H2O, Zhang et al. 2023, with offloading).

H2O keeps the heavy hitters (tokens with the largest attention mass
accumulated over all queries so far) plus a recent window. The host-centric
variant HillInfer compares against evaluates importance with exact attention
weights on the host, so every decode step of every tiered layer:

1. brings all keys to the host: every stored K block of the layer is read from
   disk (the K region only; the block file keeps K and V apart), the host part
   is in DRAM. The read is query-independent, so it is prefetched while the
   previous tiered layer computes (the same care full offload gets);
2. computes the softmax attention of the current query over all tokens and adds
   it to each token's accumulated score (summed over query heads);
3. picks the top-alpha share of the pool by accumulated score, reads the V
   pages holding them, and attends exactly over sink + selected + recent.

H2O proper evicts the tokens it does not keep; here every token stays on disk
and may come back (the offloading H2O-like variant), so accuracy is not
traded away and the comparison is about I/O. The prompt's accumulated scores
come from every prompt query's attention (causal), as in H2O.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.baselines.prompt_attention import attention_mass
from kvtier.baselines.selective_runtime import TierSetup
from kvtier.baselines.selective import Selected, SelectiveCache, SelectiveLayer, build_cache, grouped_query
from kvtier.baselines.selective_store import SelectiveStore
from kvtier.kv.gather import take_tokens
from kvtier.storage import K, V

QUERY_SLICE = 256  # prompt queries scored at once: bounds the [heads, queries, tokens] probabilities in memory


class HeavyHitters:
    """H2O's score: the attention probability each position received, summed over heads and every query so far."""

    def __init__(self, batch: int, max_tokens: int) -> None:
        self.mass = np.zeros((batch, max_tokens), dtype=np.float32)

    def add(self, probabilities: np.ndarray) -> None:
        """Add probabilities [B, n] of positions 0..n-1."""
        self.mass[:, : probabilities.shape[1]] += probabilities

    def top(self, first: int, count: int, k: int) -> np.ndarray:
        """The k of positions first..first+count-1 with the most mass, as indices from `first` [B, k], ascending."""
        order = np.argsort(-self.mass[:, first : first + count], axis=1, kind="stable")
        return np.sort(order[:, :k], axis=1)


class H2OLayer(SelectiveLayer):
    """A tiered layer selecting heavy hitters by accumulated exact attention, keys read in full every step."""

    def __init__(self, layer_idx: int, runtime) -> None:
        super().__init__(layer_idx, runtime)
        self.hitters = HeavyHitters(runtime.setup.batch_size, runtime.setup.max_tokens)

    def observe(self, query: torch.Tensor, scaling: float) -> None:
        """Accumulate the prompt chunk's attention (its queries are the last positions of the stored keys)."""
        count = query.shape[2]
        for start in range(0, count, QUERY_SLICE):
            stop = min(start + QUERY_SLICE, count)
            visible = self.tokens - count + stop
            mass = attention_mass(query[:, :, start:stop], self.keys[:, :, :visible], scaling)
            self.hitters.add(mass.cpu().numpy())

    def whole_reads(self) -> tuple[SelectiveStore, tuple[int, ...]]:
        return self.runtime.kv, (K,)

    def select(self, query: torch.Tensor, scaling: float) -> Selected:
        self.load_whole()
        pool_keys = self.pooled(K)
        sink = self.sink_tokens
        window = self.keys.cpu()
        all_keys = torch.cat([window[:, :, :sink], pool_keys, window[:, :, sink:]], dim=2)  # positions 0..N-1
        grouped = grouped_query(query, all_keys.shape[1])
        logits = torch.matmul(grouped, all_keys.float().transpose(2, 3)) * scaling
        self.hitters.add(logits.softmax(dim=-1).sum(dim=(1, 2)).numpy())
        index = self.hitters.top(sink, self.pooled_tokens, self.selection_size())
        self.runtime.kv.read_tokens(self.layer_idx, index, (V,))
        return Selected(index, take_tokens(pool_keys, index), self.gather(index, V))


def make_h2o_cache(model, setup: TierSetup) -> SelectiveCache:
    """The `--kv h2o` cache: same tiers, budgets and block file as the other modes."""
    return build_cache(model, setup, H2OLayer)
