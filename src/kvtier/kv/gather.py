"""Gathering chosen tokens out of K/V tensors and out of attention masks (shared by the sparse and baseline modes)."""

from __future__ import annotations

import numpy as np
import torch


def take_tokens(tensor: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """tensor [B, H, N, D] gathered along N by index [B, n] (per sequence)."""
    index = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))
    expanded = index[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
    return tensor.gather(2, expanded.to(tensor.device))


def select_columns(mask: torch.Tensor | None, positions: np.ndarray) -> torch.Tensor | None:
    """The mask's key columns at `positions` [B, n] (None stays None)."""
    if mask is None:
        return None
    mask = mask.expand(len(positions), *mask.shape[1:])
    index = torch.from_numpy(positions).to(mask.device)
    return mask.gather(3, index[:, None, None, :].expand(-1, mask.shape[1], mask.shape[2], -1))
