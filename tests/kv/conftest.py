"""Tiny random-weight models: enough to test KV mechanics (real-model claims live in tests/test_generation.py)."""

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="session")
def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_gemma3():
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=1024, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
    return Gemma3ForCausalLM(config).eval()
