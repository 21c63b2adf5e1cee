"""Initial placement after prefill: which prompt tokens start hot and which cold.

The prompt's own attention says which tokens matter:
the last `observation_window` prompt queries (SnapKV's observation window)
attend over all prompt keys, and each token's importance is the attention
probability it receives, summed over those queries and all heads. The most
important tokens fill the hot pool; the rest go cold, in position order so
that neighbouring cold tokens share disk pages. The importance also seeds the
hit table, so tokens the prompt already favours count as hit once.
"""

from __future__ import annotations

import numpy as np
import torch


def observation_importance(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Importance [batch, tokens] of keys [B, Hkv, N, D] for the last prompt queries [B, Hq, w, D].

    The queries are the prompt's last w positions, so query i (0-based in the window) may attend
    to keys up to position N - w + i (causal).
    """
    batch, q_heads, window, head_dim = queries.shape
    kv_heads, tokens = keys.shape[1], keys.shape[2]
    grouped = queries.float().reshape(batch, kv_heads, q_heads // kv_heads * window, head_dim)
    logits = torch.matmul(grouped, keys.float().transpose(2, 3)) * scaling  # [B, Hkv, G*w, N]
    query_pos = torch.arange(tokens - window, tokens).repeat(q_heads // kv_heads)
    future = torch.arange(tokens)[None, :] > query_pos[:, None]
    probabilities = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
    return probabilities.sum(dim=(1, 2))


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
