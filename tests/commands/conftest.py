"""A tiny random-weight model saved as a local Hugging Face directory, to drive the CLI end to end quickly."""

import pytest

import tiny_models

WORDS = "the a lighthouse code is what of blue red green number answer keeper sea ship light night".split()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return tiny_models.save_tiny_hf_dir(tmp_path_factory.mktemp("tiny-model"), WORDS, max_position_embeddings=8192)
