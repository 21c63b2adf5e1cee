"""Real-model claims: greedy output of `dense` and `offload` equals plain transformers `generate` (smollm2-135m)."""

import pytest
import torch

import kvtier
from kvtier.data.corpus import generate_text
from kvtier.generation import GenerationCancelled
from kvtier.modes import KVConfig
from kvtier.sparse.threads import decode_threads

pytestmark = pytest.mark.model
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2():
    return kvtier.load_model("smollm2-135m")


@pytest.fixture(scope="module")
def prompt(smollm2):
    """A few hundred tokens of prose and a question about it, as one chat turn."""
    text = generate_text(1600, seed=3) + "\n\nSummarise the text above in one sentence."
    ids = kvtier.prompt_ids(smollm2, text)
    assert 300 <= ids.shape[1] <= 1000
    return text, ids


@pytest.fixture(scope="module")
def reference(smollm2, prompt):
    """Plain transformers greedy generate, no kvtier cache."""
    _, ids = prompt
    with torch.inference_mode():
        out = smollm2.model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def _offload(tmp_path) -> KVConfig:
    # smollm2 in fp32 holds 46 KiB of KV per token: these budgets keep 64 tokens on the device,
    # 64 in host DRAM and the rest (most of the prompt) on disk.
    return KVConfig(kv="offload", device_kv_budget="2880KiB", host_kv_budget="2880KiB", storage_dir=str(tmp_path))


def test_dense_equals_transformers_generate(smollm2, prompt, reference):
    text, _ = prompt
    result = kvtier.generate(smollm2, text, NEW_TOKENS, KVConfig(kv="dense"), progress=False)
    assert result.token_ids == reference
    assert result.disk_bytes_read == 0


def test_offload_equals_transformers_generate_and_reads_disk(smollm2, prompt, reference, tmp_path):
    text, ids = prompt
    result = kvtier.generate(smollm2, text, NEW_TOKENS, _offload(tmp_path), progress=False)
    assert result.token_ids == reference
    on_disk = result.kv_bytes["storage"] / sum(result.kv_bytes.values())
    assert on_disk > 0.5
    # Every decode pass reads every stored block of every layer (at most one block fewer than at the end).
    block_bytes = 64 * 30 * 2 * 3 * 64 * 4
    assert result.disk_bytes_read >= (result.decode_tokens - 1) * (result.kv_bytes["storage"] - block_bytes)
    assert not list(tmp_path.iterdir())


def test_offload_cache_works_inside_model_generate(smollm2, prompt, reference, tmp_path):
    _, ids = prompt
    cache = kvtier.make_cache(smollm2, _offload(tmp_path), max_tokens=ids.shape[1] + NEW_TOKENS)
    try:
        with torch.inference_mode():
            out = smollm2.model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, cache=cache)
        assert out[0, ids.shape[1] :].tolist() == reference
        assert cache.store.file.io.stats.bytes_read > 0
    finally:
        cache.close()


def test_sparse_decodes_leaving_a_core_to_its_scorer_and_restores_the_thread_count(smollm2, tmp_path):
    """kvtier.sparse.threads: the storage scorer process needs a core while the sparse path decodes."""
    seen = []
    before = torch.get_num_threads()
    config = KVConfig(kv="sparse", host_kv_budget="4MiB", storage_dir=str(tmp_path))
    kvtier.generate(smollm2, "The capital of France is", max_new_tokens=4, kv_config=config, progress=False,
                    on_text=lambda _: seen.append(torch.get_num_threads()))
    assert seen and set(seen) == {decode_threads("sparse")}
    assert torch.get_num_threads() == before


def test_on_token_sees_every_token_watch_ends_early_and_choose_replaces_argmax(smollm2, prompt, reference):
    text, _ = prompt
    seen = []
    result = kvtier.generate(smollm2, text, NEW_TOKENS, progress=False, on_token=seen.append,
                             watch=lambda cache: len(seen) == 4)  # it sees each token's cache before on_token
    assert seen == result.token_ids == reference[:5]
    with pytest.raises(GenerationCancelled):  # cancelled in the prefill: no token at all
        kvtier.generate(smollm2, text, NEW_TOKENS, progress=False, prefill_chunk=4, on_token=seen.append,
                        watch=lambda cache: cache.get_seq_length() >= 8)
    assert seen == reference[:5]
    end = next(i for i, token in enumerate(reference) if i >= 2 and token not in reference[:i])
    stopped = kvtier.generate(smollm2, text, NEW_TOKENS, progress=False, eos_token_ids={reference[end]})
    assert stopped.token_ids == reference[: end + 1]  # the given end-of-sequence ids replace the model's
    forced = kvtier.generate(smollm2, text, 3, progress=False, choose=lambda logits: 42)
    assert forced.token_ids == [42, 42, 42]
