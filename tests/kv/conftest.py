"""Tiny random-weight models: enough to test KV mechanics (real-model claims live in tests/test_generation.py)."""

import pytest

import tiny_models


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_models.tiny_llama(num_hidden_layers=3)


@pytest.fixture(scope="session")
def tiny_gemma3():
    return tiny_models.tiny_gemma3(["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
