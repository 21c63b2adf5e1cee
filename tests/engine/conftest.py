"""Tiny random-weight models and a helper to run the serving engine on them.

Weights drawn with a large initializer_range give peaked logits, so greedy
choices have wide margins and float rounding differences between batch shapes
cannot flip them: outputs of differently scheduled runs can be compared exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM, LlamaForCausalLM

import tiny_models

from kvtier.engine.serving_engine import EngineConfig, LLMEngine
from kvtier.engine.sequence import SamplingParams

BLOCK = 16  # the smallest block size the engine accepts, so short prompts span many blocks


@pytest.fixture(scope="session")
def tiny_llama() -> LlamaForCausalLM:
    return tiny_models.tiny_llama(head_dim=16, initializer_range=0.5, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_gemma3() -> Gemma3ForCausalLM:
    return tiny_models.tiny_gemma3(["sliding_attention", "full_attention"], initializer_range=0.5)


def _run_engine(model, prompts, sampling: SamplingParams, **config) -> tuple[list[list[int]], LLMEngine]:
    """Generate with a fresh engine; return the outputs' token ids and the (closed) engine for its stats."""
    config = {"block_tokens": BLOCK, "max_batched_tokens": 64, "segment_slots": 4, "io_threads": 2} | config
    with LLMEngine(model, EngineConfig(**config)) as engine:
        outputs = engine.generate(prompts, sampling)
    engine.outputs = outputs
    return [output.token_ids for output in outputs], engine


@pytest.fixture(scope="session")
def run_engine():
    """`run_engine(model, prompts, sampling, **EngineConfig fields) -> (token ids per prompt, closed engine)`."""
    return _run_engine


@pytest.fixture
def flash_path(tmp_path: Path) -> str:
    return str(tmp_path / "flash.kvc")
