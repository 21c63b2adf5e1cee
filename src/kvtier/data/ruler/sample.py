"""One RULER-style sample, how it is fitted to a token budget, and how an answer is scored.

A task's generator builds a sample from a seed and a *size* (haystack sentences, list entries, words): the
same seed and size always give the same sample. `fit` finds the largest size whose prompt, measured by the
caller's tokenizer, leaves room for the answer within the context, as RULER sizes its haystacks to the
model's own tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError

_ROUNDS = 6  # linear estimates of the size before stepping down to a fit


@dataclass(frozen=True)
class RulerSample:
    """A task instance: the user turn, the start of the answer the model continues, and what it must name."""

    task: str
    context: str  # instructions, document and question: the user turn
    answer_prefix: str  # the answer's first words, given to the model (RULER's answer prefix)
    expected: tuple[str, ...]  # every string the answer must contain
    answer_tokens: int  # new tokens the task allows (RULER's tokens_to_generate, cut to what the answer needs)


Make = Callable[[int], RulerSample]
Measure = Callable[[RulerSample], int]


def fit(make: Make, measure: Measure, context_tokens: int) -> RulerSample:
    """The sample of `make(size)` with the largest size found whose `measure` (prompt tokens) plus its answer
    tokens is at most `context_tokens`: sizes are estimated linearly from measured ones, then stepped down.

    Raises ConfigError when even size 1 does not fit.
    """
    first = make(1)
    base = measure(first)
    budget = context_tokens - first.answer_tokens
    if base > budget:
        raise ConfigError(f"a context of {context_tokens} tokens cannot hold even the smallest {first.task} sample "
                          f"({base} prompt tokens + {first.answer_tokens} for the answer)")
    best, best_size, size = first, 1, 64
    for _ in range(_ROUNDS):
        sample = make(size)
        tokens = measure(sample)
        if tokens <= budget and size > best_size:
            best, best_size = sample, size
        estimate = 1 + int((budget - base) * (size - 1) / max(tokens - base, 1))
        if tokens > budget:
            estimate = min(estimate, size - 1)  # never try a size already too large again
        if estimate == size or estimate <= best_size:
            break
        size = estimate
    return best


def string_match_all(answer: str, expected: Sequence[str]) -> float:
    """RULER's score of one answer: the share of the expected strings it contains, case ignored."""
    text = answer.lower()
    return sum(reference.lower() in text for reference in expected) / len(expected)
