"""Fixtures for the accuracy harness: a tiny random model with a word-level tokenizer, one torch thread.

The tokenizer knows every word of the synthetic corpus and of the needles, so haystacks
tokenize to real ids; the random model answers nonsense, which is all mechanics tests need.
"""

import re

import pytest

import tiny_models
from kvtier.data.corpus import generate_text
from kvtier.data.needle import make_needles
from kvtier.models.loader import load_model
from kvtier.sparse.threads import torch_threads

CORPUS = generate_text(60_000, seed=5)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """As the sparse path decodes on the 2-core VM (kvtier.sparse.threads): the scorer process needs the other core."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def corpus_text() -> str:
    return CORPUS


@pytest.fixture(scope="session")
def tiny_llm(tmp_path_factory):
    """A LoadedModel: 2-layer random Llama (2 KV heads, head_dim 16, 8K context) and a word-level tokenizer."""
    needles = [needle for seed in range(4)
               for needle in make_needles(3, seed) + make_needles(3, seed, similar_keys=True)]
    text = " ".join([CORPUS, *(f"{needle.sentence} {needle.question}" for needle in needles)])
    words = sorted(set(re.findall(r"\w+|[^\w\s]+", text)))
    path = tiny_models.save_tiny_hf_dir(tmp_path_factory.mktemp("tiny-llm"), words, max_position_embeddings=8192)
    return load_model(str(path))
