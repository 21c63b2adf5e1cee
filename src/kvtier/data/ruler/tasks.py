"""The RULER-style tasks by name, their families, and one entry point that builds a sample fitted to a context.

Families as RULER groups them: retrieval (the needle tasks), multi-hop tracing (variable tracking) and
aggregation (common and frequent words). RULER's question answering over documents is left out: no registry
package ships such a data set with its documents (docs/decisions.md).
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.data.ruler.aggregation import common_words_sample, frequent_words_sample
from kvtier.data.ruler.niah import NEEDLE_TASKS, needle_sample
from kvtier.data.ruler.sample import Measure, RulerSample, fit
from kvtier.data.ruler.tracking import tracking_sample
from kvtier.errors import ConfigError

Generator = Callable[[str, int, int, str], RulerSample]  # (task, seed, size, corpus text) -> sample

# task -> (family, generator); the suite runs them in this order
TASKS: dict[str, tuple[str, Generator]] = {
    **{name: ("retrieval", needle_sample) for name in NEEDLE_TASKS},
    "vt": ("multi-hop", tracking_sample),
    "cwe": ("aggregation", common_words_sample),
    "fwe": ("aggregation", frequent_words_sample),
}
FAMILIES = tuple(dict.fromkeys(family for family, _ in TASKS.values()))


def family(task: str) -> str:
    return TASKS[task][0]


def make_sample(task: str, seed: int, context_tokens: int, measure: Measure, corpus_text: str) -> RulerSample:
    """Task `task`'s sample for `seed`, as large as fits `context_tokens` with its answer, tokens counted by
    `measure` (the caller's prompt: chat template and answer prefix included)."""
    if task not in TASKS:
        raise ConfigError(f"unknown RULER task {task!r}; choose from {', '.join(TASKS)}")
    generate = TASKS[task][1]
    return fit(lambda size: generate(task, seed, size, corpus_text), measure, context_tokens)
