"""Test inputs whose sums are exact, for kernels whose summation order differs from torch's."""

import torch


def small_integers(shape, seed):
    """Integers in [-4, 4] as float32: exact in bfloat16, and every product and sum of a few thousand of them exact in
    float32, so no tolerance depends on summation order."""
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).float()
