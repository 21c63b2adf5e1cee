"""Fixtures for the sparse path: tiny random models (mechanics) and single-threaded torch.

torch's intra-op thread pool spin-waits; on the 2 shared cores of CI, next to
the scorer process, two torch threads make each small op cost milliseconds.
One thread keeps these tests fast and does not change any result.
"""

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_gemma3():
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=1024, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    return Gemma3ForCausalLM(config).eval()
