"""Run the latency suite's cells (latency_grid.py): build each cell's cache, time it, record what it moved.

Every mode is timed by the same loop (kvtier.eval.sparse.decode_timing.measure_decode): prefill,
one untimed step (the sparse cache places its tiers), then `new_tokens` timed greedy steps.
Budgets follow the accuracy suite (kvtier.eval.accuracy.budgets): per sequence, the host holds a
share of the prompt's KV (default 40%) and the device a small share with a floor; a batch
gets the per-sequence budgets times its size. A cell is repeated `repeats` times with a
fresh cache each time; numbers are medians with min, max and n (kvtier.eval.record.spread).
Prompts are stretches of a public corpus (kvtier.data.corpus), one per batch row.
"""

from __future__ import annotations

import re
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from itertools import cycle, islice
from pathlib import Path

import torch
from tqdm import tqdm

from kvtier.errors import ContextTooLongError
from kvtier.eval.accuracy.budgets import BudgetShares, cell_kv_config, kv_bytes_per_token
from kvtier.eval.accuracy.corpus_slice import CHARS_PER_TOKEN_BOUND, corpus_slice
from kvtier.eval.sparse.decode_timing import measure_decode
from kvtier.eval.sparse.latency_grid import EXPERIMENTS, Cell, workload
from kvtier.eval.accuracy.needle_grid import ANSWER_TOKENS, needle_cell
from kvtier.eval.record import ResultStore, spread
from kvtier.eval.sparse.traffic import cache_bypass, sparse_details, step_traffic
from kvtier.kv.contract import tier_bytes
from kvtier.modes import KVConfig, make_cache
from kvtier.sparse import thread_settings
from kvtier.units import format_size

WARMUP_STEPS = 1
NEEDLE_PROMPT_RESERVE = 128 + ANSWER_TOKENS  # chat template, question and answer around a haystack
NEEDLE_VARIANT = "single"
TIMED = ("ms_per_token", "prefill_s", "decode_s", "latency_s", "tokens_per_s", "disk_read_bytes_per_step",
         "disk_written_bytes_per_step")


@dataclass(frozen=True)
class RunOptions:
    """What every cell of a run shares."""

    storage_dir: str
    corpus_text: str
    device_share: float = BudgetShares.device
    block_tokens: int = 64
    io_threads: int = 8
    prefill_chunk: int = 1024

    def as_settings(self) -> dict:
        """The options a result file records (the corpus text itself is not)."""
        sparse = KVConfig()
        return {"device_share": self.device_share, "block_tokens": self.block_tokens, "io_threads": self.io_threads,
                "prefill_chunk": self.prefill_chunk, "warmup_steps": WARMUP_STEPS,
                "torch_threads": thread_settings(), "score_bits": sparse.score_bits, "sink": sparse.sink,
                "recent": sparse.recent}


def run_cell(llm, cell: Cell, options: RunOptions, on_repeat: Callable[[], None] = lambda: None) -> dict:
    """Measure `cell` `cell.repeats` times (calling `on_repeat` after each), then its needle cells. The result."""
    kv_config = cell_config(llm.model, cell, options)
    ids = prompt_batch(llm.tokenizer, options.corpus_text, cell.context, cell.batch)
    runs = []
    for _ in range(cell.repeats):
        runs.append(measure_once(llm, cell, kv_config, ids, options))
        on_repeat()
    result = {"params": cell.params(), "repeats": cell.repeats, **summarize(runs),
              "budgets": {"device_kv_budget": kv_config.device_kv_budget, "host_kv_budget": kv_config.host_kv_budget,
                          "prompt_kv_bytes": cell.batch * cell.context * kv_bytes_per_token(llm.model)}}
    if cell.needles:
        result["accuracy"] = needle_accuracy(llm, cell, options)
    return result


def cell_config(model, cell: Cell, options: RunOptions) -> KVConfig:
    """The cell's KVConfig: per-sequence budgets from the prompt's KV, times the batch size."""
    shares = BudgetShares(host=cell.host_share, device=options.device_share)
    per_sequence = cell_kv_config(cell.mode, model, cell.context, shares, alpha=cell.alpha, beta=cell.beta,
                                  storage_dir=options.storage_dir, block_tokens=options.block_tokens,
                                  io_threads=options.io_threads)
    return replace(per_sequence, device_kv_budget=per_sequence.device_kv_budget * cell.batch,
                   host_kv_budget=per_sequence.host_kv_budget * cell.batch)


def prompt_batch(tokenizer, corpus_text: str, tokens: int, batch: int) -> torch.Tensor:
    """[batch, tokens] ids: row i from the corpus stretch of seed i (repeated when the text is short)."""
    rows = []
    for row in range(batch):
        text = corpus_slice(corpus_text, row, tokens)[: CHARS_PER_TOKEN_BOUND * tokens]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] or [0]
        rows.append(list(islice(cycle(ids), tokens)))
    return torch.tensor(rows, dtype=torch.long)


def build_cache(model, cell: Cell, kv_config: KVConfig, max_tokens: int, model_id: str):
    """The cell's cache: its mode through make_cache, with the cell's migration policy where it names one."""
    if cell.policy is not None:
        kv_config = replace(kv_config, policy=cell.policy)
    return make_cache(model, kv_config, max_tokens, cell.batch, model_id)


def measure_once(llm, cell: Cell, kv_config: KVConfig, ids: torch.Tensor, options: RunOptions) -> dict:
    """One prefill + decode through a fresh cache: timings, bytes per step, and the sparse path's details."""
    max_tokens = ids.shape[1] + WARMUP_STEPS + cell.new_tokens + 1
    cache = build_cache(llm.model, cell, kv_config, max_tokens, llm.model_id)
    try:
        measured = measure_decode(llm.model, cache, ids, cell.new_tokens, options.prefill_chunk, WARMUP_STEPS,
                                  decode_mode=cell.mode)
        run = {name: measured[name] for name in TIMED if name in measured}
        run["latency_s"] = measured["prefill_s"] + measured["decode_s"]
        run["tokens_per_s"] = cell.batch * cell.new_tokens / max(measured["decode_s"], 1e-9)
        run["traffic_bytes_per_step"] = step_traffic(cache, llm.model, measured, cell.alpha)
        run["kv_bytes"] = tier_bytes(cache, llm.model)
        run["cache_bypass"] = cache_bypass(cache)
        sparse = cache.sparse_view()
        if sparse is not None:
            run["sparse"] = sparse_details(sparse)
        return run
    finally:
        cache.close()


def summarize(runs: list[dict]) -> dict:
    """Timed numbers as spreads over the repeats; everything else as per-field medians."""
    summary = {name: spread([run[name] for run in runs]) for name in TIMED}
    rest = [{name: value for name, value in run.items() if name not in TIMED} for run in runs]
    return summary | median_fields(rest)


def median_fields(records: list[dict]) -> dict:
    """Field-wise median of numeric leaves of equally shaped dicts; other leaves (text, flags) from the first."""
    merged = {}
    for name, first in records[0].items():
        values = [record[name] for record in records]
        if isinstance(first, dict):
            merged[name] = median_fields(values)
        elif _is_number(first) and all(_is_number(value) for value in values):
            merged[name] = statistics.median(values)
        else:
            merged[name] = first
    return merged


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def needle_accuracy(llm, cell: Cell, options: RunOptions) -> dict:
    """Single-needle retrieval at the cell's context, alpha and budgets, over its (depth, seed) pairs."""
    kv_config = cell_config(llm.model, replace(cell, batch=1), options)
    answers = []
    for depth, seed in cell.needles:
        answer = needle_cell(llm, kv_config, cell.context, depth, NEEDLE_VARIANT, seed, options.corpus_text)
        answers.append({"depth": depth, "seed": seed, "correct": bool(answer["correct"]),
                        "answer": answer["answer"], "expected": answer["expected"]})
    correct = sum(answer["correct"] for answer in answers)
    return {"variant": NEEDLE_VARIANT, "correct": correct, "n": len(answers), "accuracy": correct / len(answers),
            "answers": answers}


def run_pending(llm, cells: list[Cell], store, options: RunOptions,
                on_repeat: Callable[[], None] = lambda: None) -> Iterator[tuple[Cell, dict]]:
    """Run the cells `store` (a kvtier.eval.record.ResultStore) has not finished, saving each at once."""
    for cell in cells:
        if not store.done(cell.key):
            result = run_cell(llm, cell, options, on_repeat)
            store.put(cell.key, result)
            yield cell, result


def run_experiment(llm, letter: str, cells: list[Cell], settings: dict, options: RunOptions, out: Path,
                   force: bool = False) -> None:
    """Every unfinished cell of one experiment, stored as each finishes in `out`'s JSON for it (`force`: rerun
    finished cells too)."""
    experiment = EXPERIMENTS[letter]
    new_tokens = max(cell.new_tokens for cell in cells)
    path = out / f"latency-{experiment.name}-{_file_safe(llm.name)}-{settings['grid']}.json"
    store = ResultStore(path, settings | {"experiment": experiment.name, "title": experiment.title,
                                          "new_tokens": new_tokens}, options.storage_dir, force=force)
    pending = [cell for cell in cells if not store.done(cell.key)]
    prefill, steps = workload(pending)
    print(f"[bench latency] {letter}) {experiment.title}: {len(cells)} cells, {len(cells) - len(pending)} finished; "
          f"to run: {prefill:,} prompt tokens, {steps:,} decode steps", file=sys.stderr)
    with tqdm(total=sum(cell.repeats for cell in pending), desc=f"{letter}) {experiment.name}", unit="run",
              file=sys.stderr) as bar:
        for cell, result in run_pending(llm, pending, store, options, on_repeat=lambda: bar.update()):
            tqdm.write(cell_line(cell, result), file=sys.stderr)
    print(f"wrote {path}")


def cell_line(cell: Cell, result: dict) -> str:
    """One line per finished cell: what ran and its median decode speed and disk reads."""
    ms = result["ms_per_token"]
    line = (f"  {cell.label} context={cell.context} batch={cell.batch}: {ms['median']:.1f} ms/token "
            f"[{ms['min']:.1f}, {ms['max']:.1f}], latency {result['latency_s']['median']:.2f} s, disk read "
            f"{format_size(int(result['disk_read_bytes_per_step']['median']))}/step")
    accuracy = result.get("accuracy")
    return line + (f", needle {accuracy['correct']}/{accuracy['n']}" if accuracy else "")


def check_contexts(llm, cells: list[Cell]) -> None:
    """Every cell's prompt, decode steps (and needle question) must fit the model's context."""
    too_long = sorted({cell.context for cell in cells if _tokens_needed(cell) > llm.context_length})
    if too_long:
        raise ContextTooLongError(
            f"contexts {', '.join(map(str, too_long))} do not fit the {llm.context_length}-token context of "
            f"{llm.name} with the decode steps and needle questions; lower --contexts/--fixed-context or use a "
            "longer-context model (--model qwen2.5-0.5b: 32K)")


def _tokens_needed(cell: Cell) -> int:
    return cell.context + max(WARMUP_STEPS + cell.new_tokens + 1, NEEDLE_PROMPT_RESERVE if cell.needles else 0)


def _file_safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"
