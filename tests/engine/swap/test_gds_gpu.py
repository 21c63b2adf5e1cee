"""The kvikio (GPUDirect Storage) flash path on a real GPU, through kvikio itself.

Skipped, with the reason shown, where there is no CUDA device or kvikio is not installed (CI is
CPU-only); the mechanics are tested on every machine in test_gds.py.
"""

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the kvikio flash path needs a GPU", allow_module_level=True)
pytest.importorskip("kvikio", reason="kvikio is not installed (pip install kvikio-cu12 or kvikio-cu13)")

from serve_pressure import LONG, PRESSURE, short_prompts  # noqa: E402
from swap_pools import clear, filled_pool, snapshot, swapped_out_then_damaged  # noqa: E402

from kvtier.errors import ChecksumError  # noqa: E402
from kvtier.engine.swap.gds import GdsFlashSwap  # noqa: E402

pytestmark = pytest.mark.gpu


def test_blocks_round_trip_between_gpu_memory_and_the_file(flash_path):
    pool = filled_pool(device="cuda")
    swap = GdsFlashSwap(pool, flash_path, num_slots=8, model_id="tiny", io_threads=4, segment_slots=4)
    try:
        assert "kvikio" in swap.io_backend
        expected = snapshot(pool, [4, 1, 3])
        pending = swap.swap_out([4, 1, 3])
        pending.wait()
        with open(flash_path, "rb") as raw:  # the bytes on disk are the GPU block's bytes, at the appendix offset
            raw.seek(swap.file.layout.offset(1, 0, pending.slots[1]))
            assert raw.read(8192) == pool.block_bytes(1, 0, 1).cpu().numpy().tobytes()
        clear(pool)
        swap.swap_in(pending.slots, [0, 2, 5])
        assert all(torch.equal(a, b) for a, b in zip(expected, snapshot(pool, [0, 2, 5])))
    finally:
        swap.close()


def test_a_damaged_block_is_caught_on_the_gpu(flash_path):
    pool = filled_pool(device="cuda")
    swap = GdsFlashSwap(pool, flash_path, num_slots=8, model_id="tiny", io_threads=4, segment_slots=4)
    try:
        pending = swapped_out_then_damaged(swap, [0, 1], layer=0, kind=1, which=0, byte=8)
        with pytest.raises(ChecksumError, match="layer 0 V slot 0"):
            swap.swap_in(pending.slots, [2, 3])
    finally:
        swap.close()


def test_engine_outputs_do_not_depend_on_where_gpu_kv_went(tiny_llama, run_engine, tmp_path):
    model = copy.deepcopy(tiny_llama).to("cuda")
    prompts = short_prompts()
    reference, calm = run_engine(model, prompts, LONG, device_blocks=64, swap="recompute")
    flash, flash_engine = run_engine(model, prompts, LONG, swap="flash", flash_path=str(tmp_path / "f.kvc"),
                                     **PRESSURE)
    dram, dram_engine = run_engine(model, prompts, LONG, swap="dram", **PRESSURE)
    flash_stats, dram_stats = flash_engine.stats(), dram_engine.stats()
    assert calm.stats()["scheduler"]["preemptions"] == 0
    assert "kvikio" in flash_stats["swap"]["io"]
    assert flash_stats["scheduler"]["swap_outs"] == dram_stats["scheduler"]["swap_outs"] >= 8
    assert flash_stats["scheduler"]["recomputes"] == 0
    assert flash == dram == reference
