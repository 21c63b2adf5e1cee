"""Initial placement after prefill: which prompt tokens start hot and which cold.

The prompt's last `observation_window` queries (SnapKV's observation window)
foresee which tokens the decode steps will choose. A decode step chooses the
top-alpha of the pool by its selection score (the query heads' raw q.k summed,
or their max: the "sum" or "max" aggregation, hot_pool.importance), so a
token's importance is that same score averaged over the window's queries,
each query over the keys it may see. The most important tokens fill the hot
pool; the rest go cold, in position order so that neighbouring cold tokens
share disk pages. Ranked by the window's attention probabilities instead, the
hot pool held about half as many of the decode steps' choices. The importance also seeds the hit table, so tokens the
prompt already favours count as hit once.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.sparse.hot.hot_pool import importance


def selection_importance(queries: torch.Tensor, keys: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Importance [batch, tokens] of keys [B, Hkv, N, D]: the selection score under `aggregation` averaged over the
    last prompt queries [B, Hq, w, D]. Query i (0-based in the window) is at position N - w + i and sees the keys up
    to it (causal); a key's average is over the queries that see it."""
    batch, q_heads, window, head_dim = queries.shape
    kv_heads, tokens = keys.shape[1], keys.shape[2]
    grouped = queries.float().reshape(batch, kv_heads, q_heads // kv_heads, window, head_dim)
    dots = torch.matmul(grouped, keys.float()[:, :, None].transpose(3, 4))  # [B, Hkv, G, w, N]
    per_query = importance(dots.flatten(3), aggregation)  # over the heads, each query's column kept: [B, w x N]
    device = keys.device  # where the prompt's K/V lie, a GPU included
    seen = torch.arange(tokens, device=device)[None, :] <= torch.arange(tokens - window, tokens, device=device)[:, None]
    total = per_query.view(batch, window, tokens).masked_fill(~seen, 0.0).sum(dim=1)
    return total / seen.sum(dim=0).clamp(min=1)


def split_hot_cold(importance: np.ndarray, hot_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices into the pool [batch, hot_tokens] and [batch, rest], both in ascending position order."""
    order = np.argsort(-importance, axis=1, kind="stable")
    return np.sort(order[:, :hot_tokens], axis=1), np.sort(order[:, hot_tokens:], axis=1)


def seed_hits(importance: np.ndarray, alpha: float) -> np.ndarray:
    """1 for the top-alpha share of tokens by importance (as if selected once), else 0; shape of `importance`."""
    count = int(np.ceil(alpha * importance.shape[1]))
    hits = np.zeros(importance.shape, dtype=np.uint8)
    np.put_along_axis(hits, np.argsort(-importance, axis=1, kind="stable")[:, :count], 1, axis=1)
    return hits
