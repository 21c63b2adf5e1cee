"""The attention mass the prompt's queries give each key: H2O's heavy-hitter score and LeoAM's chunking signal."""

from __future__ import annotations

import torch


def attention_mass(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """The attention probability [batch, tokens] each key [B, Hkv, N, D] receives, summed over the last prompt
    queries [B, Hq, w, D] and their heads. Query i (0-based in the window) may attend to keys up to position
    N - w + i (causal)."""
    batch, q_heads, window, head_dim = queries.shape
    kv_heads, tokens = keys.shape[1], keys.shape[2]
    grouped = queries.float().reshape(batch, kv_heads, q_heads // kv_heads * window, head_dim)
    logits = torch.matmul(grouped, keys.float().transpose(2, 3)) * scaling  # [B, Hkv, G*w, N]
    query_pos = torch.arange(tokens - window, tokens).repeat(q_heads // kv_heads)
    future = torch.arange(tokens)[None, :] > query_pos[:, None]
    probabilities = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
    return probabilities.sum(dim=(1, 2))

