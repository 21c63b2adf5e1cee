"""Benchmark workloads that force swapping: many long prompts, a device pool a fraction of their demand; and the
block sizes `kvtier bench serve` runs one at (`SWEEP_BLOCKS`).

Prompts are windows of one tokenized text (generated offline from a fixed seed,
so every run and every backend sees the same tokens). Outputs have a fixed
length (`ignore_eos`), so flash, DRAM and recompute runs do exactly the same work.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.data.corpus import generate_text
from kvtier.errors import ConfigError
from kvtier.engine.block_manager import blocks_for
from kvtier.engine.sequence import SamplingParams

SWEEP_BLOCKS = (16, 32, 64, 128, 256)  # the serve benchmark's block-size sweep (the HiFC paper, Fig. 6)


@dataclass(frozen=True)
class Workload:
    """`requests` prompts of min..max tokens, each generating `new_tokens`; pool = `pool_fraction` of demand.

    The full workload is 32-64 requests of 2K-8K tokens; `scaled(s)` shrinks prompt lengths
    by s but keeps the 32 requests, so as many sequences share the pool as at full size, and
    keeps at least 32 new tokens, so each sequence still grows by whole blocks after admission:
    growth past the pool is what forces swapping (with 16 new tokens and 64-token blocks most
    sequences never needed a new block, and a bench run swapped nothing).
    """

    requests: int = 32
    min_prompt_tokens: int = 2048
    max_prompt_tokens: int = 8192
    new_tokens: int = 128
    pool_fraction: float = 0.25
    seed: int = 0

    def scaled(self, scale: float) -> Workload:
        if not 0 < scale <= 1:
            raise ConfigError(f"--scale must be in (0, 1], got {scale}")
        return Workload(self.requests, max(32, round(self.min_prompt_tokens * scale)),
                        max(64, round(self.max_prompt_tokens * scale)), max(32, round(self.new_tokens * scale)),
                        self.pool_fraction, self.seed)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.new_tokens, ignore_eos=True)

    def prompts(self, encode: Any) -> list[list[int]]:
        """Token-id prompts, deterministic for the seed; `encode(text) -> ids` is the model's tokenizer."""
        rng = random.Random(self.seed)
        lengths = [rng.randint(self.min_prompt_tokens, self.max_prompt_tokens) for _ in range(self.requests)]
        tokens = encode(generate_text(min_chars=6 * max(lengths) + 1000, seed=self.seed))
        if len(tokens) < max(lengths):
            raise ConfigError(f"workload text has {len(tokens)} tokens, fewer than the {max(lengths)} a prompt needs")
        starts = [rng.randrange(0, len(tokens) - length + 1) for length in lengths]
        return [tokens[start:start + length] for start, length in zip(starts, lengths)]

    def device_blocks(self, prompts: list[list[int]], block_tokens: int) -> int:
        """Pool size: `pool_fraction` of all requests' final KV, but at least the largest request."""
        demand = [blocks_for(len(prompt) + self.new_tokens, block_tokens) for prompt in prompts]
        return max(max(demand), round(sum(demand) * self.pool_fraction))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
