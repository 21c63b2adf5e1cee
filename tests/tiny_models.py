"""Tiny random-weight models for mechanics tests (real-model claims use packaged models).

Each test folder's conftest builds its fixtures from these with the overrides it needs.
"""

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM


def tiny_llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )
    return LlamaForCausalLM(LlamaConfig(**(config | overrides))).eval()


def tiny_gemma3(layer_types: list[str], **overrides) -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    config = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=1024, sliding_window=16,
    )
    config |= dict(num_hidden_layers=len(layer_types), layer_types=layer_types) | overrides
    return Gemma3ForCausalLM(Gemma3TextConfig(**config)).eval()


def save_tiny_hf_dir(path, words: list[str], **overrides):
    """A 2-layer random Llama plus a word-level tokenizer, saved as a local Hugging Face directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{word: i + 2 for i, word in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)
    tiny_llama(vocab_size=len(vocab), eos_token_id=1, **overrides).save_pretrained(path)
    return path
