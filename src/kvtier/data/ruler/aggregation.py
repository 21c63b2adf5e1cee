"""RULER's aggregation tasks: common-word extraction (cwe) and frequent-word extraction (fwe).

Attention is spread over many tokens here: the answer is a count over the whole context, not a few tokens to
find, which is where a fixed top-k share is known to lose mass.

- cwe: a numbered list of words in which `COMMON` words appear `COMMON_REPEATS` times each and every other
  word `RARE_REPEATS` times (shuffled); the answer must name the common ones. Words are drawn from the
  corpus's own vocabulary (seeded). In a short context the common words repeat less (down to
  `MIN_COMMON_REPEATS`), so that they fill at most half of the list rather than all of it.
- fwe: "coded text" of random six-letter words whose counts follow a Zipf law (exponent 2, RULER's); the most
  frequent word is "...." (noise, as in RULER) and the answer must name the next three.
"""

from __future__ import annotations

import functools
import math
import random
import re
import string

from kvtier.data.ruler.sample import RulerSample
from kvtier.errors import ConfigError

COMMON, COMMON_REPEATS, RARE_REPEATS = 10, 30, 3
MIN_COMMON_REPEATS = 6
ZIPF_EXPONENT = 2.0
CODED_LETTERS = 6
FREQUENT = 3


def common_words_sample(name: str, seed: int, size: int, corpus_text: str) -> RulerSample:
    """The cwe sample for `seed` with `size` rare words besides the common ones."""
    vocabulary = _vocabulary(corpus_text)
    if COMMON + size > len(vocabulary):
        raise ConfigError(f"the corpus has {len(vocabulary)} distinct words, fewer than the {COMMON + size} a "
                          "common-word list needs; use a longer corpus or a shorter context")
    rng = random.Random(f"{name}:{seed}")
    drawn = rng.sample(vocabulary, COMMON + size)
    common, rare = drawn[:COMMON], drawn[COMMON:]
    words = common * common_repeats(size) + rare * RARE_REPEATS
    rng.shuffle(words)
    listing = " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))
    return RulerSample(
        task=name,
        context="Below is a numbered list of words. In these words, some appear more often than others. "
                f"Memorize the ones that appear most often.\n{listing}\n"
                f"Question: What are the {COMMON} most common words in the above list?",
        answer_prefix=f"Answer: The top {COMMON} words that appear most often in the list are:",
        expected=tuple(common),
        answer_tokens=48,
    )


def common_repeats(rare: int) -> int:
    """How often each common word appears beside `rare` rare words: RULER's 30, or as many as fill half the list."""
    return min(COMMON_REPEATS, max(MIN_COMMON_REPEATS, rare * RARE_REPEATS // COMMON))


def frequent_words_sample(name: str, seed: int, size: int, corpus_text: str = "") -> RulerSample:
    """The fwe sample for `seed` with about `size` words of coded text."""
    rng = random.Random(f"{name}:{seed}")
    vocabulary = ["...."] + _coded_words(rng, max(size // 2, FREQUENT + 2))
    zeta = math.pi**2 / 6  # zeta(2): the Zipf law's normaliser
    counts = [int(size * rank**-ZIPF_EXPONENT / zeta) for rank in range(1, len(vocabulary) + 1)]
    words = [word for word, count in zip(vocabulary, counts) for _ in range(count)]
    rng.shuffle(words)
    return RulerSample(
        task=name,
        context="Read the following coded text and track the frequency of each coded word. Find the three most "
                f"frequently appeared coded words. {' '.join(words)}\nQuestion: Do not provide any explanation. "
                "Please ignore the dots '....'. What are the three most frequently appeared words in the above "
                "coded text?",
        answer_prefix="Answer: According to the coded text above, the three most frequently appeared words are:",
        expected=tuple(vocabulary[1 : FREQUENT + 1]),
        answer_tokens=20,
    )


def _coded_words(rng: random.Random, count: int) -> list[str]:
    """`count` distinct random lowercase words of CODED_LETTERS letters."""
    words: dict[str, None] = {}
    while len(words) < count:
        words["".join(rng.choices(string.ascii_lowercase, k=CODED_LETTERS))] = None
    return list(words)


@functools.lru_cache(maxsize=2)
def _vocabulary(text: str) -> list[str]:
    """Distinct lowercase words of 4-12 letters in `text`, sorted (so a seed draws the same words every time)."""
    return sorted({word.lower() for word in re.findall(r"\b[A-Za-z]{4,12}\b", text)})
