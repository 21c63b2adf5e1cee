import numpy as np
import pytest
import torch
from exact_values import small_integers

from kvtier.kernels import ops
from kvtier.sparse.hot.hot_pool import HotPool, compiled_dots, importance

pytestmark = pytest.mark.skipif(not ops.VECTORIZED, reason="the kernel needs AVX2 and FMA")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [1, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("used", [0, 1, 15, 16, 37, 100])
@pytest.mark.parametrize("aggregation", ["sum", "max"])
def test_dots_and_importance_equal_torch_for_every_group_and_tail(dtype, group, used, aggregation):
    batch, seq_heads, head_dim, tiles = 2, 3, 64, 7
    heads = batch * seq_heads
    tiled = small_integers((heads, tiles, head_dim, 16), seed=used).to(dtype)
    keys = tiled.transpose(1, 2).reshape(heads, head_dim, tiles * 16)  # token-major columns, for torch
    query = small_integers((heads, group, head_dim), seed=group)
    out, token_importance = torch.full((heads, group, used), float("nan")), torch.full((batch, used), float("nan"))
    bits = tiled.view(torch.int16) if dtype == torch.bfloat16 else tiled
    ops.hot_dots(keys=bits.reshape(batch, seq_heads, tiles, head_dim, 16).numpy(),
                 query=query.reshape(batch, seq_heads, group, head_dim).numpy(),
                 out=out.view(batch, seq_heads, group, used).numpy(), importance=token_importance.numpy(),
                 aggregation=aggregation)
    expected = torch.matmul(query, keys[..., :used].float())
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    by_sequence = expected.reshape(batch, seq_heads, group, used)
    torch.testing.assert_close(token_importance, importance(by_sequence, aggregation), rtol=0, atol=0)


@pytest.mark.parametrize("dtype, compiled", [(torch.bfloat16, True), (torch.float32, True), (torch.float16, False)])
@pytest.mark.parametrize("group", [3, 7])
@pytest.mark.parametrize("aggregation", ["sum", "max"])
def test_a_pool_scores_as_torch_whichever_computes_it(dtype, compiled, group, aggregation):
    keys = small_integers((2, 3, 50, 64), seed=1).to(dtype)
    pool = HotPool(2, 3, 64, dtype)
    pool.append(keys, keys, np.arange(50)[None].repeat(2, axis=0))
    query = small_integers((2, 3, group, 64), seed=2)
    assert compiled_dots(dtype) == compiled
    dots, token_importance = pool.scores(query, aggregation)
    expected = torch.matmul(query, keys.float().transpose(2, 3))
    torch.testing.assert_close(dots, expected, rtol=0, atol=0)
    by_token = expected.flatten(1, 2)
    torch.testing.assert_close(token_importance, by_token.sum(dim=1) if aggregation == "sum" else by_token.amax(dim=1),
                               rtol=0, atol=0)


@pytest.mark.parametrize("change, message", [
    ({"out": np.zeros((1, 3, 2, 113), dtype=np.float32), "importance": np.zeros((1, 113), dtype=np.float32)},
     "^out: .*at most tiles x 16 = 112$"),
    ({"keys": np.zeros((1, 3, 7, 64, 16), dtype=np.int8)}, "^keys: int8 .*need C-contiguous float32 or int16"),
    ({"keys": np.zeros((1, 3, 7, 64, 8), dtype=np.int16)}, "^keys: tiles of 8 tokens, not 16$"),
    ({"keys": np.zeros((3, 7, 64, 16), dtype=np.int16)}, "^keys: shape \\(3, 7, 64, 16\\), need 5 dimensions$"),
    ({"query": np.zeros((1, 3, 0, 64), dtype=np.float32), "out": np.zeros((1, 3, 0, 100), dtype=np.float32)},
     "^out: 0 query heads"),
    ({"query": np.zeros((1, 2, 2, 64), dtype=np.float32)}, "^query: shape .* does not match keys'"),
    ({"aggregation": "mean"}, "^aggregation: 'mean'"),
    ({"query": np.zeros((1, 3, 2, 63), dtype=np.float32)}, "^query: shape .* does not match"),
    ({"query": np.zeros((1, 3, 2, 64), dtype=np.float64)}, "^query: float64"),
    ({"query": np.zeros((1, 3, 64, 2), dtype=np.float32).transpose(0, 1, 3, 2)}, "^query: .*not C-contiguous"),
    ({"out": np.zeros((1, 3, 1, 100), dtype=np.float32)}, "^out: shape .* does not match"),
    ({"importance": np.zeros((1, 10), dtype=np.float32)}, "^importance: shape .* does not match"),
])
def test_bad_shapes_are_refused(change, message):
    call = {"keys": np.zeros((1, 3, 7, 64, 16), dtype=np.int16), "query": np.zeros((1, 3, 2, 64), dtype=np.float32),
            "out": np.zeros((1, 3, 2, 100), dtype=np.float32), "importance": np.zeros((1, 100), dtype=np.float32),
            "aggregation": "sum"} | change
    with pytest.raises(ValueError, match=message):
        ops.hot_dots(**call)
