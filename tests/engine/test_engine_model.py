"""The real packaged model: greedy outputs do not depend on where the KV went."""

import pytest

from kvtier.engine.serving_engine import EngineConfig, LLMEngine
from kvtier.engine.sequence import SamplingParams

pytestmark = pytest.mark.model

PROMPTS = ["Name three primary colors.", "What is the capital of France?", "Write a haiku about the sea.",
           "List the first five prime numbers."]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def llm():
    from kvtier.models.loader import load_model

    return load_model("smollm2-135m")


def generate(llm, **config):
    config = {"block_tokens": 16, "io_threads": 4, "max_batched_tokens": 256} | config
    with LLMEngine.from_llm(llm, EngineConfig(**config)) as engine:
        outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        return [output.token_ids for output in outputs], engine.stats()["scheduler"]


def test_flash_dram_and_no_pressure_agree(llm, tmp_path):
    # Chat-templated prompts take 3 blocks of 16 tokens and grow into a 4th: 7 device blocks hold two
    # prompts but not their growth, so running sequences are preempted, swapped out and back in.
    reference, calm = generate(llm, device_blocks=64, swap="recompute")
    pressure = {"device_blocks": 7, "swap_space": "64MiB"}
    flash, flash_stats = generate(llm, swap="flash", flash_path=str(tmp_path / "f.kvc"), **pressure)
    dram, dram_stats = generate(llm, swap="dram", **pressure)
    assert calm["preemptions"] == 0
    assert flash_stats["swap_outs"] == dram_stats["swap_outs"] > 0
    assert flash_stats["swap_ins"] == flash_stats["swap_outs"] and flash_stats["recomputes"] == 0
    assert flash == dram == reference
