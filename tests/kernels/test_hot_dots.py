import numpy as np
import pytest
import torch
from exact_values import small_integers

from kvtier.kernels import _hot_dots
from kvtier.sparse.hot.hot_pool import HotPool, compiled_dots, importance

pytestmark = pytest.mark.skipif(not _hot_dots.vectorized, reason="the kernel needs AVX2 and FMA")


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
    _hot_dots.dots(bits.numpy(), query.numpy(), out.numpy(), token_importance.numpy(), int(aggregation == "max"),
                   tiled.element_size(), heads, seq_heads, group, head_dim, tiles, used)
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
    ({"used": 113}, "used <= tiles x 16"),
    ({"key_bytes": 1}, "bfloat16"),
    ({"group": 0}, "group"),
    ({"seq_heads": 2}, "multiple of seq_heads"),
    ({"aggregation": 2}, "aggregation"),
    ({"query": np.zeros((3, 2, 63), dtype=np.float32)}, "does not match"),
    ({"out": np.zeros((3, 2, 10), dtype=np.float32)}, "does not match"),
    ({"importance": np.zeros((1, 10), dtype=np.float32)}, "does not match"),
])
def test_bad_shapes_are_refused(change, message):
    call = {"keys": np.zeros((3, 7, 64, 16), dtype=np.int16), "query": np.zeros((3, 2, 64), dtype=np.float32),
            "out": np.zeros((3, 2, 100), dtype=np.float32), "importance": np.zeros((1, 100), dtype=np.float32),
            "aggregation": 0, "key_bytes": 2, "heads": 3, "seq_heads": 3, "group": 2, "head_dim": 64, "tiles": 7,
            "used": 100} | change
    with pytest.raises(ValueError, match=message):
        _hot_dots.dots(*call.values())
