"""The grids of `kvtier bench accuracy`: which contexts, needle depths and variants, seeds and perplexity tokens
a run covers (accuracy_bench.py runs them; the command's description gives the presets' sizes).

Apart from the benchmark, which imports torch, so that the command line reads the presets and checks its
options at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.data.needle import VARIANTS


@dataclass(frozen=True)
class Grid:
    contexts: tuple[int, ...] | None  # None: powers of two from 1024 up to the model's context
    depths: tuple[float, ...]
    variants: tuple[str, ...]
    seeds: int
    ppl_tokens: int


GRIDS = {
    "small": Grid((1024,), (0.1, 0.5, 0.9), VARIANTS, seeds=1, ppl_tokens=64),
    "full": Grid(None, (0.0, 0.25, 0.5, 0.75, 1.0), VARIANTS, seeds=3, ppl_tokens=256),
}
