"""Fixtures shared by the sparse and baseline KV tests (both conftests import them): tiny random
models for mechanics, and single-threaded torch.

torch's intra-op thread pool spin-waits; on the 2 shared cores of CI, next to
the scorer process, two torch threads make each small op cost milliseconds.
One thread keeps these tests fast and does not change any result.
"""

import pytest

import tiny_models
from kvtier.sparse.threads import torch_threads


@pytest.fixture(autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_models.tiny_llama()


@pytest.fixture(scope="session")
def tiny_gemma3():
    return tiny_models.tiny_gemma3(["sliding_attention", "full_attention", "sliding_attention"])
