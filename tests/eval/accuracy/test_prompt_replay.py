"""A prompt recorded once (updates and queries) and replayed leaves every mode where a real prefill leaves it."""

import pytest
import torch

from kvtier.eval.accuracy.budgets import BudgetShares, cell_kv_config
from kvtier.eval.accuracy.prompt_replay import record_prompt
from kvtier.eval.accuracy.ruler_bench import greedy_tokens
from kvtier.generation import prefill
from kvtier.kv_config import KV_MODES
from kvtier.modes import make_cache

PROMPT, CHUNK, LIVE, STEPS = 300, 128, 32, 10


def _answer(llm, kv_config, fill) -> tuple[torch.Tensor, list[int], list]:
    """(first logits, greedy tokens, attended positions of every decode step) after `fill(cache)` prefilled."""
    attended = []
    with torch.inference_mode():
        cache = make_cache(llm.model, kv_config, PROMPT + STEPS, 1)
        try:
            if hasattr(cache, "watch_attended"):
                cache.watch_attended(lambda layer, positions: attended.append((layer, positions.tolist())))
            logits = fill(cache)
            cache.place_prompt()
            tokens = greedy_tokens(llm, cache, logits, STEPS)
        finally:
            cache.close()
    return logits, tokens, attended


@pytest.mark.parametrize("kv", KV_MODES)
def test_a_replayed_prompt_decodes_as_a_real_prefill_does(tiny_llm, tmp_path, kv):
    model = tiny_llm.model
    ids = torch.randint(2, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    kv_config = cell_kv_config(kv, model, PROMPT, BudgetShares(), alpha=0.25, beta=0.5, storage_dir=str(tmp_path))
    recording = record_prompt(model, ids, CHUNK, LIVE)
    assert recording.recorded == PROMPT - LIVE and len(recording.steps) == 3 * 2  # 3 chunks x 2 layers

    def real(cache):  # the same passes: the recorded part in chunks, then the live tail
        prefill(model, cache, ids[:, : recording.recorded], CHUNK)
        return prefill(model, cache, ids[:, recording.recorded :], CHUNK)

    replayed = _answer(tiny_llm, kv_config, lambda cache: recording.prefill(model, cache))
    expected = _answer(tiny_llm, kv_config, real)
    assert torch.equal(replayed[0], expected[0])
    assert replayed[1:] == expected[1:]  # the same tokens, and every step attended the same positions
    assert (kv in ("dense", "offload")) == (not expected[2])


def test_a_one_token_chunk_is_never_recorded(tiny_llm):
    ids = torch.randint(2, 50, (1, 2 * CHUNK + 1 + LIVE))
    recording = record_prompt(tiny_llm.model, ids, CHUNK, LIVE)
    assert recording.recorded == 2 * CHUNK  # 257 would end in a one-token pass, which a selective cache decodes
    assert [keys.shape[2] for _, keys, _, _, _ in recording.steps] == [CHUNK] * 4
