"""Haystacks as lists of sentences, deterministic by seed: essay text, repeated noise, random-token strings.

- `essay`: consecutive sentences of a corpus (Paul Graham's essays where the registry is reachable) from a
  seed-dependent start, RULER's "essay" haystack.
- `noise`: RULER's repeated sentences ("The grass is green. ..."), a haystack with nothing to attend to.
- `random_tokens`: sentences of random letter-and-digit strings, a haystack whose every token is rare, so
  attention spreads over all of them.
"""

from __future__ import annotations

import functools
import random
import string

from kvtier.data.needle import split_sentences
from kvtier.errors import ConfigError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
HAYSTACKS = ("essay", "noise", "random")


def haystack(kind: str, size: int, seed: int, corpus_text: str) -> list[str]:
    """`size` sentences (noise: `size` repeats of its five) of haystack `kind`."""
    if kind == "essay":
        return essay(corpus_text, size, seed)
    if kind == "noise":
        return noise(size)
    if kind == "random":
        return random_tokens(size, seed)
    raise ConfigError(f"unknown haystack {kind!r}; choose from {', '.join(HAYSTACKS)}")


def essay(corpus_text: str, size: int, seed: int) -> list[str]:
    """`size` consecutive sentences of `corpus_text`, starting where the seed says (the same start share for
    every size, so a fit's sizes read the same stretch)."""
    sentences = _sentences(corpus_text)
    if size > len(sentences):
        raise ConfigError(f"the corpus holds {len(sentences)} sentences, fewer than the {size} a haystack needs; "
                          "use a longer corpus or a shorter context")
    start = int(random.Random(f"essay:{seed}").random() * (len(sentences) - size))
    return [sentence.strip() for sentence in sentences[start : start + size]]


def noise(size: int) -> list[str]:
    return NOISE.replace(". ", ".\n").splitlines() * size


def random_tokens(size: int, seed: int) -> list[str]:
    """`size` sentences of 6-12 random lowercase strings of letters and digits (a longer list extends a shorter)."""
    rng = random.Random(f"random-tokens:{seed}")
    alphabet = string.ascii_lowercase + string.digits
    sentences = []
    for _ in range(size):
        words = ["".join(rng.choices(alphabet, k=rng.randint(2, 7))) for _ in range(rng.randint(6, 12))]
        sentences.append(" ".join(words).capitalize() + ".")
    return sentences


def insert(sentences: list[str], facts: list[str], depths: list[float]) -> list[str]:
    """`sentences` with `facts[i]` before the sentence nearest depth `depths[i]` (0 first, 1 last), in order."""
    placed = sorted(zip(depths, range(len(facts))), key=lambda pair: pair[0])
    result, taken = [], 0
    for depth, index in placed:
        at = max(taken, round(depth * len(sentences)))
        result += sentences[taken:at] + [facts[index]]
        taken = at
    return result + sentences[taken:]


@functools.lru_cache(maxsize=2)
def _sentences(text: str) -> tuple[str, ...]:
    """Sentences of a corpus (split once per corpus: the fits ask for many sizes)."""
    return tuple(piece for piece in split_sentences(text) if piece.strip())
