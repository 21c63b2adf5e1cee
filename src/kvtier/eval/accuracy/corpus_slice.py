"""Seed-dependent stretches of a corpus, so that repeats of an experiment read different text.

Seed 0 reads the corpus from its start; seed s starts at the first paragraph break at or
after `s * STRIDE_CHARS` characters, wrapped so that about `tokens` tokens still follow it.
"""

from __future__ import annotations

STRIDE_CHARS = 50_000
CHARS_PER_TOKEN_BOUND = 8  # English prose runs 4-5 characters per token; 8 leaves room for any tokenizer


def corpus_slice(text: str, seed: int, tokens: int) -> str:
    """The text from the seed's starting paragraph on (the whole text for seed 0 or a short corpus)."""
    room = len(text) - CHARS_PER_TOKEN_BOUND * tokens
    if seed == 0 or room <= 0:
        return text
    start = text.find("\n\n", (seed * STRIDE_CHARS) % room)
    return text if start < 0 else text[start:].lstrip()
