"""Needle-in-a-haystack cells: one haystack prompt, one greedy answer through a KV mode, scored.

A cell is (context, depth, variant, seed) for one KV config:

- `single`: one needle at `depth`;
- `multi-needle`: `MULTI_NEEDLES` needles with unrelated keys, the one asked at `depth`
  and the others spread evenly around the document;
- `multi-key`: the same placement, but the keys differ in one word only
  (`make_needles(similar_keys=True)`), so the others are distractors for the one asked.

The seed picks the needles and where in the corpus the haystack starts (corpus_slice).
An answer is correct when it names the asked value and no other needle's (score_answer).
`needle_cell` is the reusable unit (the latency suite's accuracy-vs-alpha sweep calls it);
`needle_summary` turns finished cells into accuracy per mode and retention against dense.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.data.corpus import load_corpus
from kvtier.data.needle import VARIANTS, HaystackPrompt, build_haystack, make_needles, score_answer
from kvtier.errors import ConfigError
from kvtier.eval.accuracy.corpus_slice import CHARS_PER_TOKEN_BOUND, corpus_slice
from kvtier.generation import generate
from kvtier.models.prompts import prompt_ids
from kvtier.modes import KVConfig

MULTI_NEEDLES = 3
ANSWER_TOKENS = 16  # a four-digit value and end-of-sequence take a handful; room for a short sentence


def needle_prompt(tokenizer, corpus_text: str, context_tokens: int, depth: float, variant: str,
                  seed: int) -> HaystackPrompt:
    """The haystack of one cell: about `context_tokens` document tokens, the asked needle at `depth`."""
    if variant not in VARIANTS:
        raise ConfigError(f"unknown needle variant {variant!r}; choose from {', '.join(VARIANTS)}")
    count = 1 if variant == "single" else MULTI_NEEDLES
    needles = make_needles(count, seed, similar_keys=variant == "multi-key")
    depths = [(depth + i / count) % 1.0 if i else depth for i in range(count)]
    text = corpus_slice(corpus_text, seed, context_tokens)
    return build_haystack(tokenizer, text, context_tokens, needles, depths, ask=0)


def needle_cell(llm, kv_config: KVConfig, context_tokens: int, depth: float, variant: str, seed: int,
                corpus_text: str | None = None, max_new_tokens: int = ANSWER_TOKENS) -> dict:
    """Answer one haystack question greedily through `kv_config`'s cache and score it.

    Args:
        llm: a LoadedModel.
        kv_config: the KV mode and budgets (for tiered modes, size budgets from the prompt: eval.budgets).
        context_tokens: document tokens of the haystack (the prompt adds the chat template and question).
        depth: where the asked needle sits, 0 = first sentence, 1 = last.
        variant: one of VARIANTS.
        seed: picks the needles and the stretch of corpus.
        corpus_text: the haystack text; default: load_corpus("auto").

    Returns: `correct`, the answer and expected value, token counts, the asked needle's token
    position in the prompt, and the generation's timings and disk bytes.
    """
    if corpus_text is None:
        corpus_text = load_corpus("auto", min_chars=2 * CHARS_PER_TOKEN_BOUND * context_tokens, progress=False).text
    prompt = needle_prompt(llm.tokenizer, corpus_text, context_tokens, depth, variant, seed)
    ids = prompt_ids(llm, prompt.prompt)
    result = generate(llm, prompt.prompt, max_new_tokens, kv_config, progress=False, input_ids=ids)
    return {
        "correct": score_answer(result.text, prompt.expected, prompt.distractors),
        "answer": result.text,
        "expected": prompt.expected,
        "distractors": list(prompt.distractors),
        "document_tokens": prompt.context_tokens,
        "prompt_tokens": result.prefill_tokens,
        "needle_token_position": prompt.needle_token_positions[0],
        "prefill_s": result.prefill_s,
        "ms_per_token": result.ms_per_token,
        "disk_bytes_read": result.disk_bytes_read,
    }


def needle_summary(cells: Iterable[dict]) -> dict[str, dict]:
    """Accuracy per mode (overall, per variant, per context and depth) and retention against dense.

    `cells` are needle cells carrying their grid coordinates (`mode`, `context`, `depth`, `variant`,
    `seed`). Retention = the mode's correct answers / dense's, over the coordinates both ran (None
    where dense answered none of them correctly).
    """
    answers: dict[str, dict[tuple, bool]] = {}
    for cell in cells:
        coordinates = (cell["context"], cell["depth"], cell["variant"], cell["seed"])
        answers.setdefault(cell["mode"], {})[coordinates] = bool(cell["correct"])
    dense = answers.get("dense", {})
    return {mode: _mode_summary(mode_answers, dense) for mode, mode_answers in answers.items()}


def _mode_summary(answers: dict[tuple, bool], dense: dict[tuple, bool]) -> dict:
    variants: dict[str, list[bool]] = {}
    grid: dict[int, dict[float, list[bool]]] = {}
    for (context, depth, variant, _), correct in answers.items():
        variants.setdefault(variant, []).append(correct)
        grid.setdefault(context, {}).setdefault(depth, []).append(correct)
    shared = [coordinates for coordinates in answers if coordinates in dense]
    dense_correct = sum(dense[coordinates] for coordinates in shared)
    return {
        "all": _accuracy(list(answers.values())),
        "variants": {variant: _accuracy(values) for variant, values in variants.items()},
        "grid": {context: {depth: _accuracy(values) for depth, values in depths.items()}
                 for context, depths in grid.items()},
        "retention": sum(answers[c] for c in shared) / dense_correct if dense_correct else None,
    }


def _accuracy(answers: list[bool]) -> dict[str, float | int]:
    return {"accuracy": sum(answers) / len(answers), "correct": sum(answers), "n": len(answers)}
