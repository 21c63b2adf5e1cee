"""Long-text perplexity through a KV mode, teacher-forced one token per decode step, with attention-mass recall.

A cell prefills `prefix_tokens` tokens of a corpus through the mode's cache, then feeds the
next `new_tokens` tokens one at a time (each a decode step, so selective modes select) and
sums the negative log-likelihood of the token that follows each: ppl = exp(mean NLL). Only
decode-step predictions are scored; the prefill is exact in every mode.

When the mode's cache reports the positions it attends (`watch_attended`), a dense cache
runs in lockstep on the same tokens and the step's attention-mass recall is computed per
layer (attention_mass.py); modes in EXACT_MODES have recall 1.0 by definition, others None.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Iterable
from contextlib import ExitStack

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvtier.data.corpus import load_corpus
from kvtier.errors import ConfigError
from kvtier.eval.accuracy.mass_recall import AttendedPositions, DenseAttentionProbe, reports_attended
from kvtier.eval.accuracy.corpus_slice import CHARS_PER_TOKEN_BOUND, corpus_slice
from kvtier.eval.record import spread
from kvtier.kv_config import EXACT_MODES
from kvtier.models.prompts import check_context
from kvtier.modes import KVConfig, make_cache


def corpus_ids(tokenizer, corpus_text: str, tokens: int, seed: int) -> torch.Tensor:
    """`tokens` consecutive token ids [1, tokens] of the corpus, from the seed's starting paragraph."""
    text = corpus_slice(corpus_text, seed, tokens)[: CHARS_PER_TOKEN_BOUND * tokens]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    if len(ids) < tokens:
        raise ConfigError(f"the corpus holds {len(ids)} tokens from seed {seed}'s start, fewer than the {tokens} "
                          "a perplexity cell needs; use a shorter context or a longer corpus")
    return torch.tensor([ids], dtype=torch.long)


def perplexity_cell(llm, kv_config: KVConfig, prefix_tokens: int, new_tokens: int, seed: int,
                    corpus_text: str | None = None, prefill_chunk: int = 1024, progress: bool = False) -> dict:
    """Teacher-forced perplexity of `new_tokens` corpus tokens after a `prefix_tokens` prefix, through `kv_config`.

    Returns `nll` (mean), `ppl`, the token counts, `attention_mass_recall` (mean over layers and
    steps; 1.0 for EXACT_MODES, None for a mode that does not report what it attends),
    `recall_by_layer`, and for a mode that estimates the mass it kept (the sparse cache's
    `watch_mass`) that estimate's error against the recall, per layer and step: `mass_estimate_mae`
    (mean absolute) and `mass_estimate_bias` (mean signed); None otherwise.
    """
    check_context(llm, prefix_tokens, new_tokens)
    if corpus_text is None:
        corpus_text = load_corpus("auto", min_chars=2 * CHARS_PER_TOKEN_BOUND * prefix_tokens, progress=False).text
    ids = corpus_ids(llm.tokenizer, corpus_text, prefix_tokens + new_tokens + 1, seed)
    model = llm.model
    total = prefix_tokens + new_tokens
    nlls: list[float] = []
    recalls: dict[int, list[float]] = {}
    errors: list[float] = []
    with torch.inference_mode(), ExitStack() as stack:
        cache = make_cache(model, kv_config, total, 1, llm.model_id)
        stack.callback(cache.close)
        lockstep = _DenseLockstep(stack, model, cache, total) if reports_attended(cache) else None
        _prefill_caches(model, ids[:, :prefix_tokens], cache, lockstep, prefill_chunk)
        steps = tqdm(range(new_tokens), desc=f"ppl {kv_config.kv}", unit="tok", disable=not progress,
                     file=sys.stderr, leave=False)
        for step in steps:
            position = prefix_tokens + step
            token, target = ids[:, position : position + 1].to(model.device), ids[0, position + 1 : position + 2]
            logits = model(input_ids=token, cache=cache).logits[0, -1:].float()
            nlls.append(float(F.cross_entropy(logits, target.to(logits.device))))
            if lockstep is not None:
                for layer, value in lockstep.step(token).items():
                    recalls.setdefault(layer, []).append(value)
                    if layer in lockstep.estimated:
                        errors.append(lockstep.estimated[layer] - value)
    nll = statistics.fmean(nlls)
    return {"nll": nll, "ppl": math.exp(nll), "prefix_tokens": prefix_tokens, "new_tokens": new_tokens,
            **_recall_fields(kv_config.kv, lockstep is not None, recalls),
            "mass_estimate_mae": statistics.fmean(map(abs, errors)) if errors else None,
            "mass_estimate_bias": statistics.fmean(errors) if errors else None}


def _prefill_caches(model, prefix: torch.Tensor, cache, lockstep: _DenseLockstep | None, chunk: int) -> None:
    """Feed the prefix in chunks to the mode's cache and to the lockstep dense cache."""
    for start in range(0, prefix.shape[1], chunk):
        piece = prefix[:, start : start + chunk].to(model.device)
        model(input_ids=piece, cache=cache, logits_to_keep=1)
        if lockstep is not None:
            model(input_ids=piece, cache=lockstep.dense, logits_to_keep=1)


def _recall_fields(mode: str, measured: bool, recalls: dict[int, list[float]]) -> dict:
    if measured:
        by_layer = {layer: statistics.fmean(values) for layer, values in sorted(recalls.items())}
        every = [value for values in recalls.values() for value in values]
        return {"attention_mass_recall": statistics.fmean(every) if every else None, "recall_by_layer": by_layer}
    return {"attention_mass_recall": 1.0 if mode in EXACT_MODES else None, "recall_by_layer": {}}


class _DenseLockstep:
    """A dense cache fed the same tokens as the mode's; each step returns the mode's recall per layer. `estimated`:
    per layer, the mass the mode's cache estimates it kept at the last step (batch 1), where it estimates one."""

    def __init__(self, stack: ExitStack, model, cache, max_tokens: int) -> None:
        self.model = model
        self.attended = AttendedPositions()
        cache.watch_attended(self.attended)
        self.estimated: dict[int, float] = {}
        if hasattr(cache, "watch_mass"):
            cache.watch_mass(lambda layer, kept: self.estimated.__setitem__(layer, float(kept[0])))
        self.probe = stack.enter_context(DenseAttentionProbe(model))
        self.dense = make_cache(model, KVConfig(), max_tokens)

    def step(self, token: torch.Tensor) -> dict[int, float]:
        with self.probe.capturing():
            self.model(input_ids=token, cache=self.dense)
        return self.probe.recall(self.attended.take())


def perplexity_summary(cells: Iterable[dict]) -> dict[str, dict[int, dict]]:
    """Per mode and context: ppl and recall as median with spread over seeds, and the ppl delta vs dense.

    `cells` carry their coordinates (`mode`, `context`, `seed`). The delta is per seed against
    the dense cell of the same context and seed (None where dense did not run it).
    """
    by_mode: dict[str, dict[tuple[int, int], dict]] = {}
    for cell in cells:
        by_mode.setdefault(cell["mode"], {})[(cell["context"], cell["seed"])] = cell
    dense = by_mode.get("dense", {})
    summary: dict[str, dict[int, dict]] = {}
    for mode, cells_of_mode in by_mode.items():
        for context in sorted({context for context, _ in cells_of_mode}):
            runs = {seed: cell for (c, seed), cell in cells_of_mode.items() if c == context}
            deltas = [cell["ppl"] - dense[(context, seed)]["ppl"]
                      for seed, cell in runs.items() if (context, seed) in dense]
            recalls = [cell["attention_mass_recall"] for cell in runs.values()
                       if cell["attention_mass_recall"] is not None]
            errors = [cell["mass_estimate_mae"] for cell in runs.values() if cell.get("mass_estimate_mae") is not None]
            summary.setdefault(mode, {})[context] = {
                "ppl": spread([cell["ppl"] for cell in runs.values()]),
                "ppl_delta": spread(deltas) if deltas else None,
                "attention_mass_recall": spread(recalls) if recalls else None,
                "mass_estimate_mae": spread(errors) if errors else None,
            }
    return summary
