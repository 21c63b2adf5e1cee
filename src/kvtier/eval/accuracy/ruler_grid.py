"""What `kvtier bench ruler` runs: its modes (one table), default contexts per model, tasks and samples.

Apart from the benchmark, which imports torch, so that the command line checks its options at once.
A mode of the suite is one entry of `SUITE_MODES`: a name and the KVConfig fields that make it (budgets and
the storage dir are the suite's, the same for every mode). A new setting of a mode (an adaptive budget, say)
is one more entry.
"""

from __future__ import annotations

from kvtier.data.ruler import TASKS

SUITE_MODES: dict[str, dict] = {
    "dense": {"kv": "dense"},
    "offload": {"kv": "offload"},  # a check: its answers must equal dense's token for token
    "sparse-0.2": {"kv": "sparse", "alpha": 0.2},
    "sparse-0.1": {"kv": "sparse", "alpha": 0.1},
    "sparse-p0.9": {"kv": "sparse", "top_p": 0.9},  # the adaptive budget (`--top-p`) at two masses
    "sparse-p0.95": {"kv": "sparse", "top_p": 0.95},
    "h2o": {"kv": "h2o", "alpha": 0.2},
    "infinigen": {"kv": "infinigen", "alpha": 0.2},
    "leoam": {"kv": "leoam", "alpha": 0.2},
    "quest": {"kv": "quest", "alpha": 0.2},
}
REFERENCE = "dense"  # retention is measured against it
MUST_EQUAL = {"offload": REFERENCE}  # mode -> the mode whose generated tokens it must repeat exactly

# RULER's lengths for each model: three contexts up to the model's own (prompt + answer tokens)
DEFAULT_CONTEXTS = {"smollm2-135m": (2048, 4096, 8192), "qwen2.5-0.5b": (4096, 8192, 16384)}
FALLBACK_CONTEXTS = (2048, 4096)
SAMPLES = 8  # per task and context; sample i uses seed i


def default_contexts(model: str) -> tuple[int, ...]:
    return DEFAULT_CONTEXTS.get(model, FALLBACK_CONTEXTS)


TASK_NAMES = tuple(TASKS)
