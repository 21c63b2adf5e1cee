import numpy as np
import torch

from kvtier.engine.kv_pool import KVPool
from kvtier.storage import PAGE, KVGeometry, is_aligned


def test_blocks_are_page_aligned_views_of_the_tensors():
    # 3 heads x 64 dims x fp16 x 16 tokens = 6144 bytes: padded to a stride of 8192.
    pool = KVPool(KVGeometry(2, 3, 64, "float16"), num_blocks=4, block_tokens=16)
    assert pool.layout.block_stride == 2 * PAGE
    assert pool.keys(1).shape == (4, 16, 3, 64) and pool.keys(1).dtype == torch.float16
    view = pool.block_bytes(1, 0, 2)
    assert view.nbytes == 6144 and view.ctypes.data % PAGE == 0
    pool.keys(1)[2, 5, 1, 7] = 3.5
    as_tensor = torch.from_numpy(view.copy()).view(torch.float16).reshape(16, 3, 64)
    assert as_tensor[5, 1, 7] == 3.5
    assert float(pool.keys(1)[2].abs().sum()) == 3.5  # nothing else written


def test_whole_page_blocks_are_aligned_for_direct_io_and_bf16_works():
    pool = KVPool(KVGeometry(1, 2, 64, "bfloat16"), num_blocks=3, block_tokens=16)
    assert pool.layout.block_bytes == PAGE
    assert all(is_aligned(pool.block_bytes(0, kind, block)) for kind in (0, 1) for block in range(3))
    pool.values(0)[1] = 1.0
    assert np.count_nonzero(pool.block_bytes(0, 1, 1)) > 0
    assert np.count_nonzero(pool.block_bytes(0, 1, 0)) == 0
    assert pool.nbytes == 1 * 2 * 3 * PAGE
