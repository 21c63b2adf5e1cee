"""kvtier.make_cache: caches for a model the user loaded with transformers, closed by a `with` block."""

import pytest
import torch

import kvtier
import tiny_models
from kvtier.docstore import document_store
from kvtier.errors import ConfigError
from kvtier.kv.contract import KVCache


def test_make_cache_takes_a_transformers_model_and_closes_its_files_as_a_context_manager(tmp_path):
    model = tiny_models.tiny_llama(num_hidden_layers=2)  # a plain transformers LlamaForCausalLM
    config = kvtier.KVConfig(kv="offload", device_kv_budget="16KiB", host_kv_budget=0, storage_dir=str(tmp_path),
                             block_tokens=16)
    ids = torch.randint(0, model.config.vocab_size, (1, 80))
    with kvtier.make_cache(model, config, max_tokens=96) as cache, torch.inference_mode():
        assert isinstance(cache, KVCache)
        model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)
        assert cache.io_stats().bytes_written > 0 and list(tmp_path.iterdir())
    assert not list(tmp_path.iterdir())  # leaving the block deleted the KV file


def test_make_cache_sizes_a_transformers_model_by_its_context_length(tmp_path):
    model = tiny_models.tiny_llama(num_hidden_layers=2)
    with kvtier.make_cache(model, kvtier.KVConfig(kv="offload", storage_dir=str(tmp_path), block_tokens=16)) as cache:
        assert cache.layers[0].get_max_length() >= model.config.max_position_embeddings


def test_the_document_store_is_public_and_a_second_prompt_on_a_document_reuses_it(tmp_path):
    words = [f"w{i}" for i in range(40)]
    llm = kvtier.load_model(str(tiny_models.save_tiny_hf_dir(tmp_path / "model", words)))
    store = kvtier.DocumentStore(tmp_path / "store")
    assert kvtier.DocumentStore().root == document_store.default_store_dir()  # no argument: the CLI's store
    document = " ".join(words[i % 40] for i in range(300))
    first = kvtier.generate(llm, document + " w1", max_new_tokens=2, kv_store=store, progress=False)
    second = kvtier.generate(llm, document + " w2", max_new_tokens=2, kv_store=store, progress=False)
    assert first.reused_prompt_tokens == 0 and second.reused_prompt_tokens > 200


def test_generate_and_prompt_ids_take_a_model_loaded_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    words = [f"w{i}" for i in range(40)]
    directory = tiny_models.save_tiny_hf_dir(tmp_path / "model", words)
    ours = kvtier.load_model(str(directory))
    model, tokenizer = AutoModelForCausalLM.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    prompt = " ".join(words[:20])
    assert torch.equal(kvtier.prompt_ids(model, prompt, tokenizer=tokenizer), kvtier.prompt_ids(ours, prompt))
    expected = kvtier.generate(ours, prompt, max_new_tokens=6, progress=False).token_ids
    assert kvtier.generate(model, prompt, max_new_tokens=6, progress=False, tokenizer=tokenizer).token_ids == expected
    assert kvtier.generate(model, prompt, max_new_tokens=6, progress=False).token_ids == expected  # its directory's


def test_a_transformers_model_without_a_known_tokenizer_is_a_one_line_error():
    model = tiny_models.tiny_llama(num_hidden_layers=2)  # built in memory: no directory holds its tokenizer
    with pytest.raises(ConfigError, match=r"^LlamaForCausalLM was not loaded from a local directory.*tokenizer="):
        kvtier.generate(model, "hi", max_new_tokens=1, progress=False)
    with pytest.raises(ConfigError, match="expected a kvtier.load_model.. result or a transformers model, got str"):
        kvtier.prompt_ids("smollm2-135m", "hi")
