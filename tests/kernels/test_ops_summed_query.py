import numpy as np
import pytest
import torch

from kvtier.kernels import ops
from kvtier.sparse.lookahead import FoldedProjection

pytestmark = pytest.mark.skipif(not ops.VECTORIZED, reason="the kernel needs AVX2 and FMA")


def _projection(kv_heads: int, head_dim: int, width: int, bias: bool, seed: int) -> FoldedProjection:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(kv_heads * head_dim, width, generator=generator)
    return FoldedProjection(weight, torch.randn(kv_heads * head_dim, generator=generator) if bias else None, 1e-6,
                            kv_heads)


def _rotation(rotations: int, head_dim: int, seed: int) -> torch.Tensor:
    angles = torch.rand(rotations, 1, 1, 1, head_dim, generator=torch.Generator().manual_seed(seed)) * 6.0
    return torch.cat([angles.cos(), angles.sin()], dim=1)


@pytest.mark.parametrize("batch, rotations", [(1, 1), (3, 3), (3, 1)])
@pytest.mark.parametrize("width, bias", [(64, False), (72, True), (131, True)])  # 72, 131: tails of 8 and of 1-7
def test_the_compiled_query_is_torchs_within_float_rounding(monkeypatch, batch, rotations, width, bias):
    projection = _projection(kv_heads=2, head_dim=16, width=width, bias=bias, seed=width)
    hidden = (torch.randn(batch, width, generator=torch.Generator().manual_seed(batch)) * 3.0).requires_grad_()
    rotation = _rotation(rotations, 16, seed=rotations)
    compiled = projection.summed_query(hidden, rotation)
    monkeypatch.setattr(ops, "VECTORIZED", False)  # the same call through torch's ops
    reference = projection.summed_query(hidden, rotation)
    assert compiled.shape == reference.shape == (batch, 2, 1, 16)
    torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-5)


def _zeros(*shape):
    return np.zeros(shape, dtype=np.float32)


@pytest.mark.parametrize("change, message", [
    ({"rotation": _zeros(2, 2, 15), "weight": _zeros(30, 64), "out": _zeros(2, 2, 15)}, "even head_dim"),
    ({"weight": _zeros(40, 64)}, "^weight: 40 rows are not a whole number of heads of rotation's head_dim 16$"),
    ({"rotation": _zeros(2, 2, 0)}, "^weight: .*head_dim 0$"),
    ({"hidden": _zeros(0, 64), "rotation": _zeros(1, 2, 16), "out": _zeros(0, 2, 16)}, "batch"),
    ({"hidden": _zeros(2, 63)}, "^weight: shape .* does not match hidden's"),
    ({"bias": _zeros(31)}, "^bias: shape .* does not match weight's"),
    ({"bias": np.zeros(32)}, "^bias: float64"),
    ({"rotation": _zeros(3, 2, 16)}, "^rotation: shape \\(3, 2, 16\\) does not match \\[1 or batch 2, 2, head_dim\\]$"),
    ({"rotation": _zeros(2, 3, 16)}, "^rotation: shape .* does not match"),
    ({"rotation": _zeros(2, 2, 12)}, "^weight: 32 rows are not a whole number of heads"),
    ({"out": _zeros(2, 32)}, "^out: shape \\(2, 32\\) does not match \\[batch, heads, head_dim\\] .* \\(2, 2, 16\\)$"),
    ({"out": _zeros(2, 1, 16)}, "^out: shape .* does not match"),
    ({"hidden": _zeros(64, 2).T}, "^hidden: .*not C-contiguous"),
])
def test_bad_shapes_are_refused(change, message):
    call = {"hidden": _zeros(2, 64), "weight": _zeros(32, 64), "bias": None, "rotation": _zeros(2, 2, 16),
            "out": _zeros(2, 2, 16), "epsilon": 1e-6} | change
    with pytest.raises(ValueError, match=message):
        ops.summed_query(**call)
