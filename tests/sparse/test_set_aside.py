"""A sparse cache set aside to a file and brought back continues exactly; a damaged file or a full disk is an error
that loses nothing."""

import errno

import pytest
import torch

from kvtier.errors import ChecksumError, StorageError
from kvtier.kv.contract import tier_bytes
from kvtier.sparse import set_aside as set_aside_module
from kvtier.sparse.layer import SparseLayer
from sparse_steps import ids, run, sparse_cache

STEPS = 12


def _reference(model, tmp_path, prompt, **settings):
    cache = sparse_cache(model, tmp_path, 340, **settings)
    try:
        return run(model, cache, prompt, STEPS)
    finally:
        cache.close()


@pytest.mark.parametrize("lookahead", [{"lookahead": False}, {"lookahead_skip": 1, "lookahead_min_cold": 1}],
                         ids=["in-order", "lookahead"])
def test_set_aside_and_brought_back_between_steps_the_logits_are_unchanged(tiny_llama, tmp_path, lookahead):
    prompt = ids(1, 300, 11)
    reference = _reference(tiny_llama, tmp_path, prompt, alpha=0.2, **lookahead)
    written = []

    def aside_at_steps_3_and_7(step, cache):
        if step in (3, 7):
            held = tier_bytes(cache, tiny_llama)
            written.append((cache.set_aside(), held))
            after = tier_bytes(cache, tiny_llama)
            assert after == {"device": 0, "host": 0, "storage": sum(held.values())}  # the window and hot pool on disk
            assert all(layer.hot.values.numel() == 0 for layer in cache.layers if isinstance(layer, SparseLayer))
            cache.bring_back()

    cache = sparse_cache(tiny_llama, tmp_path, 340, alpha=0.2, **lookahead)
    try:
        resumed = run(tiny_llama, cache, prompt, STEPS, between_steps=aside_at_steps_3_and_7)
        assert cache.set_aside_bytes == 0
    finally:
        cache.close()
    assert torch.equal(reference, resumed)
    for nbytes, held in written:  # the window and hot pool only, in whole pages per layer: never the cold pool
        assert held["device"] + held["host"] <= nbytes <= held["device"] + held["host"] + 2 * 4096
    assert not list(tmp_path.iterdir())


def test_a_damaged_set_aside_file_is_a_checksum_error_and_close_removes_it(tiny_llama, tmp_path):
    cache = sparse_cache(tiny_llama, tmp_path, 340, alpha=0.2)
    try:
        run(tiny_llama, cache, ids(1, 300, 12), 2)
        cache.set_aside()
        path = next(tmp_path.glob("*.aside"))
        with open(path, "r+b") as file:
            file.seek(5000)
            byte = file.read(1)
            file.seek(5000)
            file.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(ChecksumError, match="failed their checksum"):
            cache.bring_back()
        assert cache.set_aside_bytes > 0  # nothing restored from a damaged file
    finally:
        cache.close()
    assert not list(tmp_path.iterdir())


def test_a_full_disk_while_setting_aside_leaves_the_cache_as_it_was(tiny_llama, tmp_path, monkeypatch):
    prompt = ids(1, 300, 13)
    reference = _reference(tiny_llama, tmp_path, prompt, alpha=0.2)

    def disk_full(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    def aside_on_a_full_disk(step, cache):
        if step == 4:
            with monkeypatch.context() as patch:
                patch.setattr(set_aside_module, "_write", disk_full)
                with pytest.raises(StorageError, match="No space left"):
                    cache.set_aside()
            assert not list(tmp_path.glob("*.aside*"))

    cache = sparse_cache(tiny_llama, tmp_path, 340, alpha=0.2)
    try:
        continued = run(tiny_llama, cache, prompt, STEPS, between_steps=aside_on_a_full_disk)
    finally:
        cache.close()
    assert torch.equal(reference, continued)


def test_a_cache_still_in_its_prompt_is_not_set_aside(tiny_llama, tmp_path):
    cache = sparse_cache(tiny_llama, tmp_path, 340)
    try:
        with torch.inference_mode():
            tiny_llama(input_ids=ids(1, 64, 14), cache=cache)
        with pytest.raises(RuntimeError, match="prompt is not placed"):
            cache.set_aside()
    finally:
        cache.close()
