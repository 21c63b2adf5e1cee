"""Fixtures for the document KV store: a tiny random model with a word-level tokenizer, a store per test."""

import re

import pytest

import tiny_models
from kvtier.data.corpus import generate_text
from kvtier.models.loader import load_model
from kvtier.docstore import DocumentStore

DOCUMENT = generate_text(6_000, seed=11)


@pytest.fixture(scope="session")
def document() -> str:
    return DOCUMENT


@pytest.fixture(scope="session")
def tiny_llm(tmp_path_factory):
    """A LoadedModel: 2-layer random Llama (2 KV heads, head_dim 16) whose tokenizer knows every word used here."""
    words = sorted(set(re.findall(r"\w+|[^\w\s]+", DOCUMENT + " What is it about ? Name one place .")))
    path = tiny_models.save_tiny_hf_dir(tmp_path_factory.mktemp("tiny-llm"), words, max_position_embeddings=8192)
    return load_model(str(path))


@pytest.fixture()
def store(tmp_path) -> DocumentStore:
    return DocumentStore(tmp_path / "store")
