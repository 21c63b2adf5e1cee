"""A recorded prefill replayed into a mode's cache must leave it exactly as a computed prefill would."""

import gc

import pytest
import torch

from kvtier.eval.sparse.decode_timing import measure_decode
from kvtier.generation import prefill
from kvtier.eval.sparse.prefill_tape import _RecordingCache, record
from kvtier.modes import KVConfig, make_cache

PROMPT, CHUNK = 300, 128
MODES = {
    "dense": lambda directory: KVConfig(),
    "offload": lambda directory: KVConfig(kv="offload", device_kv_budget="16KiB", host_kv_budget="32KiB",
                                          storage_dir=str(directory), block_tokens=16),
    "sparse": lambda directory: KVConfig(kv="sparse", alpha=0.2, beta="0.5", host_kv_budget="32KiB",
                                         storage_dir=str(directory)),
}


def _prompt(model, rows: int, tokens: int = PROMPT, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(seed))


def _prefilled_logits(model, config: KVConfig, ids: torch.Tensor, tape=None) -> tuple[torch.Tensor, int]:
    cache = make_cache(model, config, ids.shape[1] + 1)
    try:
        with torch.inference_mode():
            logits = prefill(model, cache, ids, CHUNK) if tape is None else tape.prefill(model, cache)
        return logits, cache.get_seq_length()
    finally:
        cache.close()


@pytest.mark.parametrize("mode", MODES)
def test_replay_gives_the_logits_and_length_of_a_computed_prefill(tiny_llm, tmp_path, mode):
    model, ids = tiny_llm.model, _prompt(tiny_llm.model, 1)
    tape = record(model, ids, CHUNK)
    computed, computed_length = _prefilled_logits(model, MODES[mode](tmp_path), ids)
    replayed, replayed_length = _prefilled_logits(model, MODES[mode](tmp_path), ids, tape)
    assert torch.equal(replayed, computed) and replayed_length == computed_length == PROMPT
    last_chunk_only, _ = _prefilled_logits(model, KVConfig(), ids[:, tape.recorded :])
    assert not torch.allclose(last_chunk_only, computed)  # the comparison would notice a replay that fed nothing


def test_a_replayed_sparse_prompt_decodes_the_same_tokens(tiny_llm, tmp_path):
    """The last chunk runs for real, so the sparse path's observation window (placement) sees real queries."""
    model, ids = tiny_llm.model, _prompt(tiny_llm.model, 1, seed=1)
    tape = record(model, ids, CHUNK)
    runs = []
    for given in (None, tape):
        cache = make_cache(model, MODES["sparse"](tmp_path), PROMPT + 8)
        try:
            runs.append(measure_decode(model, cache, ids, new_tokens=5, prefill_chunk=CHUNK, tape=given))
        finally:
            cache.close()
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    assert [run["prefill_replayed"] for run in runs] == [False, True]


def test_rows_are_recorded_one_at_a_time_and_stacked(tiny_llm):
    model, ids = tiny_llm.model, _prompt(tiny_llm.model, 2, tokens=200)
    tape = record(model, ids, 64)
    alone = record(model, ids[1:2], 64)
    layers = model.config.num_hidden_layers
    assert tape.recorded == 192 and len(tape.updates) == 3 * layers  # three whole chunks; the last 8 tokens run live
    row = tape.rows(slice(1, 2))
    assert [update[0] for update in row.updates] == [update[0] for update in alone.updates]
    for (_, keys, values), (_, alone_keys, alone_values) in zip(row.updates, alone.updates):
        assert torch.equal(keys, alone_keys) and torch.equal(values, alone_values)


def test_progress_counts_the_passes_of_a_real_prefill(tiny_llm):
    model, ids = tiny_llm.model, _prompt(tiny_llm.model, 1)
    tape = record(model, ids, CHUNK)
    ticks = []
    cache = make_cache(model, KVConfig(), PROMPT)
    with torch.inference_mode():
        tape.prefill(model, cache, lambda: ticks.append(1))
    assert len(ticks) == tape.passes == 3  # 128 + 128 replayed, 44 computed


def test_a_prompt_within_one_chunk_is_computed_whole(tiny_llm):
    model, ids = tiny_llm.model, _prompt(tiny_llm.model, 1, tokens=40)
    tape = record(model, ids, CHUNK)
    assert tape.recorded == 0 and tape.updates == []
    replayed, length = _prefilled_logits(model, KVConfig(), ids, tape)
    computed, _ = _prefilled_logits(model, KVConfig(), ids)
    assert torch.equal(replayed, computed) and length == 40


def test_each_rows_recording_cache_is_freed_without_the_cycle_collector(tiny_llm):
    """Rows' dense caches must go when their row is done: a reference cycle kept them to 22 GiB at batch 8 x 32K."""
    model, ids = tiny_llm.model, _prompt(tiny_llm.model, 3, tokens=200)
    gc.collect()
    gc.disable()
    try:
        record(model, ids, 64)
        alive = [obj for obj in gc.get_objects() if type(obj) is _RecordingCache]
    finally:
        gc.enable()
    assert alive == []
