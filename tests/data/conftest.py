"""Fixtures for kvtier.data: tokenizers trained here on generated text (nothing is downloaded)."""

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvtier.data.corpus import generate_text


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "network: reaches a package registry (PyPI); deselect with -m 'not network'")


@pytest.fixture(scope="session")
def corpus_text() -> str:
    return generate_text(120_000, seed=7)


def _byte_level_bpe(text: str) -> Tokenizer:
    """GPT-2 / Qwen style: a space is part of the next word's token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([text], trainer)
    return tokenizer


def _llama_like_bpe(text: str) -> Tokenizer:
    """Llama-2 / Gemma style: the normaliser prepends '▁' to every encoded string, so a sentence
    that starts with a space counts one token more alone than inside the document."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"], show_progress=False)
    tokenizer.train_from_iterator(text.split(". "), trainer)
    return tokenizer


def _word_level(text: str) -> Tokenizer:
    """One token per word or punctuation mark; unknown words map to <unk>."""
    pre_tokenizer = pre_tokenizers.Whitespace()
    words = {word for word, _ in pre_tokenizer.pre_tokenize_str(text)}
    vocab = {word: index for index, word in enumerate(["<unk>", *sorted(words)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizer
    return tokenizer


_TRAINERS = {"byte_level_bpe": _byte_level_bpe, "llama_like_bpe": _llama_like_bpe, "word_level": _word_level}


@pytest.fixture(scope="session")
def tokenizers_by_kind(corpus_text: str) -> dict[str, PreTrainedTokenizerFast]:
    return {kind: PreTrainedTokenizerFast(tokenizer_object=train(corpus_text)) for kind, train in _TRAINERS.items()}


@pytest.fixture(params=list(_TRAINERS))
def tokenizer(request: pytest.FixtureRequest, tokenizers_by_kind) -> PreTrainedTokenizerFast:
    """Each kind in turn: for properties that depend on how a tokenizer treats piece boundaries."""
    return tokenizers_by_kind[request.param]


@pytest.fixture
def bpe_tokenizer(tokenizers_by_kind) -> PreTrainedTokenizerFast:
    """One kind: for properties that do not depend on the tokenizer."""
    return tokenizers_by_kind["byte_level_bpe"]
