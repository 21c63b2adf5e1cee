import numpy as np
import pytest
import torch

from kvtier.kernels import _summed_query
from kvtier.sparse.lookahead import FoldedProjection

pytestmark = pytest.mark.skipif(not _summed_query.vectorized, reason="the kernel needs AVX2 and FMA")


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
    monkeypatch.setattr(_summed_query, "vectorized", 0)  # the same call through torch's ops
    reference = projection.summed_query(hidden, rotation)
    assert compiled.shape == reference.shape == (batch, 2, 1, 16)
    torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, message", [
    ({"head_dim": 15}, "even head_dim"),
    ({"rows": 40}, "multiple"),
    ({"batch": 0}, "batch"),
    ({"hidden": np.zeros((2, 63), dtype=np.float32)}, "does not match"),
    ({"bias": np.zeros(31, dtype=np.float32)}, "does not match"),
    ({"rotation": np.zeros((2, 2, 12), dtype=np.float32)}, "does not match"),
    ({"out": np.zeros((2, 16), dtype=np.float32)}, "does not match"),
])
def test_bad_shapes_are_refused(change, message):
    call = {"hidden": np.zeros((2, 64), dtype=np.float32), "weight": np.zeros((32, 64), dtype=np.float32),
            "bias": b"", "rotation": np.zeros((2, 2, 16), dtype=np.float32),
            "out": np.zeros((2, 32), dtype=np.float32), "batch": 2, "width": 64, "rows": 32, "head_dim": 16,
            "epsilon": 1e-6} | change
    with pytest.raises(ValueError, match=message):
        _summed_query.summed_query(*call.values())
