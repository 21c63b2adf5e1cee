"""Fixtures for the baseline KV modes: tiny random models, single-threaded torch, helpers in baseline_runs.py."""

import sys
from pathlib import Path

import pytest
import torch

import tiny_models

sys.path.insert(0, str(Path(__file__).parent))  # baseline_runs, under pytest's importlib mode


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_models.tiny_llama()


@pytest.fixture(scope="session")
def tiny_gemma3():
    return tiny_models.tiny_gemma3(["sliding_attention", "full_attention", "sliding_attention"])
