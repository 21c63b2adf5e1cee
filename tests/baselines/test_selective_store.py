"""SelectiveStore: chosen tokens are read as the pages holding them (or their blocks), into their fixed rows."""

import numpy as np
import pytest
import torch

from kvtier.baselines.selective_store import SelectiveStore
from kvtier.storage import PAGE, SECTOR, IOEngine, K, KVBlockFile, KVGeometry, V

# 3 KV heads x 64 dims x fp16 = 384 bytes per token (smollm2-135m's K or V): a 64-token block is 6 pages,
# and tokens straddle page boundaries (4096 / 384 is not whole).
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=3, head_dim=64, dtype="float16")
BLOCK, BATCH, BLOCKS_PER_SEQ = 64, 2, 4


@pytest.fixture
def store(tmp_path, request):
    page_checksums = getattr(request, "param", True)
    io = IOEngine(2)
    file = KVBlockFile.create(tmp_path / "kv.kvt", GEOMETRY, BLOCK, BLOCKS_PER_SEQ * BATCH, "test", io=io,
                              page_checksums=page_checksums)
    store = SelectiveStore(file, {0: 0, 1: 1}, BATCH, buffers=2)
    yield store
    store.close()
    io.close()


def _written(store) -> tuple[torch.Tensor, torch.Tensor]:
    """Three blocks per sequence of layer 1 appended; their K and V [B, H, tokens, D]."""
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(BATCH, 3, 3 * BLOCK, 64, generator=generator).half() for _ in range(2))
    store.append(1, keys, values)
    return keys, values


def test_chosen_tokens_land_in_their_rows_and_cost_only_their_pages(store):
    keys, values = _written(store)
    rows = [np.array([5, 10, 100, 191, 500]), np.array([0, 64])]  # 500: past the stored tokens (host DRAM)
    before = store.file.io.stats.snapshot()
    store.read_tokens(1, rows, (K, V), buffer=1)
    moved = store.file.io.stats.minus(before)
    # 4 KiB pages: sequence 0: token 5 in page 0, 10 straddles pages 0-1, 100 in page 9, 191 in page 17;
    # sequence 1: 0 and 64 in pages 0 and 6: 4 + 2 pages per kind (no gap of one page to bridge).
    # Sectors: sequence 0: tokens 5 and 10 in sectors 3-4 and 7-8 (5-6 bridged), 100 in 75, 191 in 143;
    # sequence 1: 0 and 64 in sectors 0 and 48: 10 per kind
    assert moved.bytes_read == (2 * 6 * PAGE if store.file.page_bytes == PAGE else 2 * 10 * SECTOR)
    for kind, tensor in ((K, keys), (V, values)):
        got = store.tokens(kind, buffer=1).permute(0, 2, 1, 3)
        for seq, row in enumerate(rows):
            wanted = row[row < 3 * BLOCK]
            assert torch.equal(got[seq, :, wanted], tensor[seq, :, wanted])


def test_a_background_read_fills_the_same_rows(store):
    keys, _ = _written(store)
    store.submit_tokens(1, [np.array([77]), np.array([3])], (K,)).result(timeout=30)
    got = store.tokens(K).permute(0, 2, 1, 3)
    assert torch.equal(got[0, :, 77], keys[0, :, 77]) and torch.equal(got[1, :, 3], keys[1, :, 3])


@pytest.mark.parametrize("store", [False], indirect=True)
def test_without_page_checksums_the_blocks_holding_the_tokens_are_read(store):
    keys, _ = _written(store)
    before = store.file.io.stats.snapshot()
    store.read_tokens(1, [np.array([5, 10, 100]), np.array([130])], (K,))
    assert store.file.io.stats.minus(before).bytes_read == 3 * 6 * PAGE  # blocks 0 and 1, and block 2
    assert torch.equal(store.tokens(K).permute(0, 2, 1, 3)[1, :, 130], keys[1, :, 130])
