"""`kvtier bench ruler`'s experiment: every (context, task, sample) asked of every mode, scored as RULER scores.

What is measured and why: the command's description (kvtier.commands.bench_ruler). A sample is generated
once (kvtier.data.ruler), its prompt prefilled densely once and replayed into each mode's cache
(prompt_replay.py), then each mode decodes its greedy answer, up to the task's cap or an end of sequence, or
until it names every expected string (its score cannot change after that: decode steps saved on two cores).
Cells are stored as they finish, so a run resumes where it stopped; the report (ruler_report.py) covers every
finished cell.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvtier.data.corpus import load_corpus
from kvtier.data.ruler import RulerSample, family, make_sample, string_match_all
from kvtier.errors import ContextTooLongError, KvtierError
from kvtier.eval.accuracy.accuracy_bench import cache_bypass
from kvtier.eval.accuracy.budgets import BudgetShares, cell_kv_config, kv_bytes_per_token
from kvtier.eval.accuracy.prompt_replay import LIVE_TOKENS, RecordedPrompt, record_prompt
from kvtier.eval.accuracy.ruler_grid import MUST_EQUAL, SUITE_MODES
from kvtier.eval.accuracy.ruler_report import write_markdown
from kvtier.eval.record import ResultStore, cell_key
from kvtier.models.prompts import prompt_ids
from kvtier.modes import make_cache
from kvtier.sparse import decoding
from kvtier.sparse.threads import torch_threads

PREFILL_CHUNK = 1024
PREFILL_THREADS = os.cpu_count() or 1  # a prompt goes in before any scorer works: every core (modes decode on theirs)
CORPUS_CHARS = 400_000  # essay stretches and the common-word vocabulary for 16K-token prompts, with room


class ModesDiffer(KvtierError):
    """A mode that must repeat another's answers token for token (offload: dense's) did not."""


@dataclass(frozen=True)
class RulerCell:
    """One answer: a task's sample `seed` at `context` tokens, asked of suite mode `mode`."""

    task: str
    context: int
    seed: int
    mode: str

    @property
    def key(self) -> str:
        return cell_key(**asdict(self))


@dataclass(frozen=True)
class RulerOptions:
    """Where a run reads and writes, and the sparse path's beta."""

    corpus: str
    beta: str | float
    storage_dir: Path
    out: Path
    force: bool  # rerun finished cells


def run_ruler(llm, tasks: list[str], contexts: tuple[int, ...], samples: int, modes: list[str],
              shares: BudgetShares, options: RulerOptions) -> Path:
    """Every unfinished cell, stored as each finishes (a line per cell on stderr), then the markdown of every
    finished cell beside the results file; the results file's path. Raises ModesDiffer when offload's tokens
    differ from dense's."""
    _check_contexts(llm, contexts)
    corpus = load_corpus(options.corpus, min_chars=CORPUS_CHARS, progress=False)
    store = ResultStore(options.out / f"ruler-{llm.name}.json", _settings(llm, corpus, shares, options),
                        options.storage_dir, force=options.force)
    store.data["grid"] = {"tasks": tasks, "contexts": list(contexts), "samples": samples, "modes": modes}
    modes = [mode for mode in SUITE_MODES if mode in modes]  # a reference before the modes checked against it
    for context in contexts:
        for task in tasks:
            for seed in range(samples):
                cells = [RulerCell(task, context, seed, mode) for mode in modes]
                pending = [cell for cell in cells if not store.done(cell.key)]
                if pending:
                    _run_sample(llm, pending, store, shares, options, corpus.text)
    write_markdown(store.path, store.data)
    return store.path


def _run_sample(llm, cells: list[RulerCell], store: ResultStore, shares: BudgetShares, options: RulerOptions,
                corpus_text: str) -> None:
    """Generate one sample, record its prefill, and answer it in each of `cells`' modes."""
    first = cells[0]
    sample = make_sample(first.task, first.seed, first.context, lambda s: sample_ids(llm, s).shape[1], corpus_text)
    ids = sample_ids(llm, sample)
    with torch_threads(PREFILL_THREADS):
        recording = record_prompt(llm.model, ids, PREFILL_CHUNK)
    for cell in cells:
        started = time.perf_counter()
        result = run_cell(llm, cell, sample, recording, shares, options)
        store.put(cell.key, result)
        print(_cell_line(cell, result, time.perf_counter() - started), file=sys.stderr, flush=True)
        _check_equal(store, cell, result)


def sample_ids(llm, sample: RulerSample) -> torch.Tensor:
    """The prompt [1, n]: the task as the user's turn, then the answer's first words as the model's."""
    ids = prompt_ids(llm, sample.context)
    prefix = sample.answer_prefix if llm.has_chat_template else "\n" + sample.answer_prefix
    prefix_ids = llm.tokenizer(prefix, add_special_tokens=False)["input_ids"]
    return torch.cat([ids, torch.tensor([prefix_ids], dtype=torch.long)], dim=1)


def run_cell(llm, cell: RulerCell, sample: RulerSample, recording: RecordedPrompt, shares: BudgetShares,
             options: RulerOptions) -> dict:
    """Answer `sample` greedily through `cell.mode`'s cache (budgets sized from the cell's context); the record."""
    fields = dict(SUITE_MODES[cell.mode])
    kv = fields.pop("kv")
    kv_config = cell_kv_config(kv, llm.model, cell.context, shares, beta=options.beta,
                               storage_dir=str(options.storage_dir), **fields)
    prompt_tokens = recording.ids.shape[1]
    with torch.inference_mode():
        cache = make_cache(llm.model, kv_config, prompt_tokens + sample.answer_tokens, 1, llm.model_id)
        try:
            with torch_threads(PREFILL_THREADS):  # H2O sums every prompt query's attention here: a prefill's work
                logits = recording.prefill(llm.model, cache)
            with decoding(kv):
                cache.place_prompt()
                started = time.perf_counter()
                tokens = greedy_tokens(llm, cache, logits, sample.answer_tokens, _names_all(llm, sample))
                decode_s = time.perf_counter() - started
            read = cache.io_stats().bytes_read
            budget = cache.attention_budget()
        finally:
            cache.close()
    answer = llm.tokenizer.decode(tokens, skip_special_tokens=True)
    return asdict(cell) | {
        "family": family(cell.task), "kv": kv, "top_p": kv_config.top_p,
        "alpha": kv_config.alpha if kv not in ("dense", "offload") and kv_config.top_p is None else None,
        "score": string_match_all(answer, sample.expected), "answer": answer, "expected": list(sample.expected),
        "token_ids": tokens, "prompt_tokens": prompt_tokens, "ms_per_token": decode_s * 1000 / max(len(tokens) - 1, 1),
        "disk_bytes_read": read, "attention_budget": budget, "device_kv_budget": kv_config.device_kv_budget,
        "host_kv_budget": kv_config.host_kv_budget, "context_kv_bytes": cell.context * kv_bytes_per_token(llm.model),
    }


def greedy_tokens(llm, cache, logits: torch.Tensor, limit: int,
                  done: Callable[[list[int]], bool] = lambda tokens: False) -> list[int]:
    """Greedy ids after the prompt whose last logits [1, vocab] are `logits`: up to `limit`, an end of sequence, or
    until `done(ids)`."""
    eos = llm.model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, (list, tuple)) else {eos if eos is not None else llm.tokenizer.eos_token_id}
    tokens = [int(logits.argmax(dim=-1)[0])]
    while tokens[-1] not in eos and len(tokens) < limit and not done(tokens):
        step = torch.tensor([[tokens[-1]]], device=llm.model.device)
        logits = llm.model(input_ids=step, cache=cache, use_cache=True).logits[:, -1]
        tokens.append(int(logits.argmax(dim=-1)[0]))
    return tokens


def _names_all(llm, sample: RulerSample) -> Callable[[list[int]], bool]:
    """Whether an answer's ids already name every expected string: more tokens cannot lower its score then."""
    return lambda tokens: string_match_all(llm.tokenizer.decode(tokens, skip_special_tokens=True), sample.expected) == 1


def _check_equal(store: ResultStore, cell: RulerCell, result: dict) -> None:
    """Raise ModesDiffer when `cell`'s mode must repeat another's tokens and that one's finished cell differs."""
    reference = MUST_EQUAL.get(cell.mode)
    other = RulerCell(cell.task, cell.context, cell.seed, reference).key if reference else None
    if other is None or not store.done(other) or store.get(other)["token_ids"] == result["token_ids"]:
        return
    raise ModesDiffer(f"{cell.mode} answered {result['answer']!r} where {reference} answered "
                      f"{store.get(other)['answer']!r} ({cell.task}, context {cell.context}, sample {cell.seed}): "
                      f"{cell.mode} must equal {reference} token for token; both cells are in {store.path}")


def _settings(llm, corpus, shares: BudgetShares, options: RulerOptions) -> dict:
    """What every cell of a results file shares (a file of other settings is refused unless --force)."""
    return {"model": llm.name, "corpus": {"name": corpus.name, "license": corpus.license, "source": corpus.source},
            "beta": options.beta, **shares.as_dict(), "suite_modes": SUITE_MODES, "prefill_chunk": PREFILL_CHUNK,
            "live_tokens": LIVE_TOKENS, "torch_threads": torch.get_num_threads(), "prefill_threads": PREFILL_THREADS,
            "cache_bypass": cache_bypass(options.storage_dir)}


def _check_contexts(llm, contexts: tuple[int, ...]) -> None:
    too_long = [context for context in contexts if context > llm.context_length]
    if too_long:
        raise ContextTooLongError(f"--contexts {','.join(map(str, too_long))} exceed {llm.name}'s "
                                  f"{llm.context_length}-token context (prompt and answer)")


def _cell_line(cell: RulerCell, result: dict, seconds: float) -> str:
    return (f"[bench ruler] {cell.task} context={cell.context} sample={cell.seed} {cell.mode}: score "
            f"{result['score']:.2f} (answered {result['answer'][:60]!r}, expected {', '.join(result['expected'])}) "
            f"{seconds:.1f} s")
