import numpy as np
import pytest
import torch

from kvtier.sparse import _hot_dots
from kvtier.sparse.hot_pool import HotPool

pytestmark = pytest.mark.skipif(not _hot_dots.vectorized, reason="the kernel needs AVX2 and FMA")


def _small_integers(shape, seed):
    # exact in bfloat16, and every product and sum exact in float32: no tolerance depends on summation order
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).float()


@pytest.mark.parametrize("group", [1, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("used", [0, 1, 15, 16, 37, 100])
def test_dots_equal_the_float32_product_for_every_group_and_tail(group, used):
    heads, head_dim, capacity = 3, 64, 112
    keys = _small_integers((heads, head_dim, capacity), seed=used).bfloat16()
    query = _small_integers((heads, group, head_dim), seed=group)
    out = torch.full((heads, group, used), float("nan"))
    _hot_dots.dots(keys.view(torch.int16).numpy(), query.numpy(), out.numpy(), heads, group, head_dim, capacity, used)
    torch.testing.assert_close(out, torch.matmul(query, keys[..., :used].float()), rtol=0, atol=0)


def test_a_bfloat16_pool_scores_as_its_float32_twin():
    keys = _small_integers((2, 3, 50, 64), seed=1)
    positions = np.arange(50)[None].repeat(2, axis=0)
    pools = {dtype: HotPool(2, 3, 64, dtype) for dtype in (torch.bfloat16, torch.float32)}
    for dtype, pool in pools.items():
        pool.append(keys.to(dtype), keys.to(dtype), positions)
    query = _small_integers((2, 3, 3, 64), seed=2)
    torch.testing.assert_close(pools[torch.bfloat16].dots(query), pools[torch.float32].dots(query), rtol=0, atol=0)


@pytest.mark.parametrize("change, message", [
    ({"used": 113}, "used <= capacity"),
    ({"group": 0}, "group"),
    ({"query": np.zeros((3, 2, 63), dtype=np.float32)}, "does not match"),
    ({"out": np.zeros((3, 2, 10), dtype=np.float32)}, "does not match"),
])
def test_bad_shapes_are_refused(change, message):
    call = {"keys": np.zeros((3, 64, 112), dtype=np.int16), "query": np.zeros((3, 2, 64), dtype=np.float32),
            "out": np.zeros((3, 2, 100), dtype=np.float32), "heads": 3, "group": 2, "head_dim": 64,
            "capacity": 112, "used": 100} | change
    with pytest.raises(ValueError, match=message):
        _hot_dots.dots(*call.values())
