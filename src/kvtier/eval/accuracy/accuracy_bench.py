"""`kvtier bench accuracy`'s experiment: the grid of needle and perplexity cells, one cell's run, the report.

What is measured and why: the command's description (kvtier.commands.bench_accuracy).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from kvtier.data.corpus import load_corpus
from kvtier.data.needle import VARIANTS
from kvtier.errors import ContextTooLongError, StorageError
from kvtier.eval.accuracy.budgets import BudgetShares, cell_kv_config, kv_bytes_per_token
from kvtier.eval.accuracy.corpus_slice import CHARS_PER_TOKEN_BOUND, STRIDE_CHARS
from kvtier.eval.accuracy.accuracy_grid import Grid
from kvtier.eval.accuracy.needle_grid import ANSWER_TOKENS, MULTI_NEEDLES, needle_cell, needle_summary
from kvtier.eval.accuracy.perplexity import perplexity_cell, perplexity_summary
from kvtier.eval.record import ResultStore, accepts_direct_io, cell_key, spread
from kvtier.eval.report_text import spread_text, tally_text
from kvtier.units import format_size

PROMPT_RESERVE = 128  # chat template and question around the haystack document
FULL_CONTEXT_STEP = 256  # the full grid's longest context is rounded down to this


@dataclass(frozen=True)
class Cell:
    """One unit of work: a needle question or a perplexity run, for one mode."""

    kind: str  # "needle" or "ppl"
    mode: str
    context: int
    seed: int
    depth: float | None = None  # needle cells
    variant: str | None = None  # needle cells
    tokens: int | None = None  # ppl cells: teacher-forced tokens

    def coordinates(self) -> dict:
        return {name: value for name, value in asdict(self).items() if value is not None}

    @property
    def key(self) -> str:
        return cell_key(**self.coordinates())


@dataclass(frozen=True)
class AccuracyOptions:
    """Where a run reads and writes, and the selective modes' settings."""

    corpus: str
    alpha: float
    beta: str | float
    top_p: float | None  # the sparse mode's adaptive budget (None: the fixed share alpha)
    storage_dir: Path
    out: Path
    force: bool  # rerun finished cells


def run_accuracy(llm, grid: Grid, modes: list[str], shares: BudgetShares, options: AccuracyOptions) -> Path:
    """Every unfinished cell of `grid` for `modes`, stored as each finishes, then the report of every finished
    cell (this run's and earlier ones); the report's path."""
    contexts = grid.contexts or full_contexts(llm.context_length, _reserve(grid))
    _check_contexts(llm, contexts, _reserve(grid))
    corpus = load_corpus(options.corpus, min_chars=_corpus_chars(max(contexts), grid.seeds), progress=False)
    settings = {"model": llm.name, "corpus": {"name": corpus.name, "license": corpus.license, "source": corpus.source},
                "alpha": options.alpha, "top_p": options.top_p, "beta": options.beta, **shares.as_dict(), "multi_needles": MULTI_NEEDLES,
                "answer_tokens": ANSWER_TOKENS, "torch_threads": 1, "cache_bypass": cache_bypass(options.storage_dir)}
    store = ResultStore(options.out / f"accuracy-{llm.name}.json", settings, options.storage_dir, force=options.force)
    store.data["grid"] = asdict(grid) | {"contexts": contexts, "modes": modes}  # this run's; seeds are the repeats
    cells = grid_cells(modes, contexts, grid)
    pending = [cell for cell in cells if not store.done(cell.key)]
    print(f"[bench accuracy] {llm.name}: {len(cells)} cells, {len(cells) - len(pending)} already finished",
          file=sys.stderr)
    kv_options = {"alpha": options.alpha, "beta": options.beta, "storage_dir": str(options.storage_dir)}
    top_p = {"top_p": options.top_p} if options.top_p is not None else {}  # the sparse mode's alone
    for cell in tqdm(pending, desc="accuracy cells", unit="cell", file=sys.stderr):
        result = run_cell(llm, cell, corpus.text, shares, **kv_options, **(top_p if cell.mode == "sparse" else {}))
        store.put(cell.key, result)
        tqdm.write(_cell_line(cell, result), file=sys.stderr)
    report = markdown(store.data, list(store.cells().values()))  # every finished cell, this run's and earlier ones
    markdown_path = store.path.with_suffix(".md")
    _write_text(markdown_path, report)
    print(report)
    print(f"wrote {store.path} and {markdown_path}")
    return markdown_path


def grid_cells(modes: list[str], contexts: tuple[int, ...], grid: Grid) -> list[Cell]:
    """Every cell, modes innermost so that an interrupted run leaves comparable cells."""
    cells = []
    for context in contexts:
        for seed in range(grid.seeds):
            for depth in grid.depths:
                for variant in grid.variants:
                    cells += [Cell("needle", mode, context, seed, depth=depth, variant=variant) for mode in modes]
            cells += [Cell("ppl", mode, context, seed, tokens=grid.ppl_tokens) for mode in modes]
    return cells


def run_cell(llm, cell: Cell, corpus_text: str, shares: BudgetShares, **options) -> dict:
    """Run one cell through its mode with budgets sized from the cell's context; the stored result."""
    kv_config = cell_kv_config(cell.mode, llm.model, cell.context, shares, **options)
    if cell.kind == "needle":
        result = needle_cell(llm, kv_config, cell.context, cell.depth, cell.variant, cell.seed, corpus_text)
    else:
        result = perplexity_cell(llm, kv_config, cell.context, cell.tokens, cell.seed, corpus_text, progress=True)
    budgets = {"device_kv_budget": kv_config.device_kv_budget, "host_kv_budget": kv_config.host_kv_budget,
               "context_kv_bytes": cell.context * kv_bytes_per_token(llm.model)}
    return cell.coordinates() | budgets | result


def full_contexts(context_length: int, reserve: int) -> tuple[int, ...]:
    """Powers of two from 1024 below the longest usable context, then that context (rounded down)."""
    longest = (context_length - reserve) // FULL_CONTEXT_STEP * FULL_CONTEXT_STEP
    contexts = []
    context = 1024
    while context < longest:
        contexts.append(context)
        context *= 2
    return (*contexts, longest)


def cache_bypass(storage_dir: Path) -> str:
    """How KV files in `storage_dir` avoid the page cache: O_DIRECT, or nothing where the filesystem refuses it."""
    return "O_DIRECT" if accepts_direct_io(storage_dir) else "none (filesystem refused O_DIRECT; buffered reads may hit the page cache)"


def _reserve(grid: Grid) -> int:
    """Tokens a context must leave free: question and answer, or the teacher-forced tokens."""
    return max(PROMPT_RESERVE + ANSWER_TOKENS, grid.ppl_tokens)


def _check_contexts(llm, contexts: tuple[int, ...], reserve: int) -> None:
    longest = llm.context_length - reserve
    too_long = [context for context in contexts if context > longest]
    if too_long:
        raise ContextTooLongError(
            f"--contexts {','.join(map(str, too_long))} exceed what {llm.name} supports: at most {longest} tokens "
            f"({llm.context_length}-token context, {reserve} kept for the question and answer or perplexity tokens)")


def _corpus_chars(longest_context: int, seeds: int) -> int:
    """Characters the corpus needs so that every seed's stretch holds the longest context."""
    return CHARS_PER_TOKEN_BOUND * longest_context + STRIDE_CHARS * seeds


def _write_text(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as error:
        raise StorageError(f"cannot write {path}: {error.strerror}") from None


def _cell_line(cell: Cell, result: dict) -> str:
    where = ", ".join(f"{name}={value}" for name, value in cell.coordinates().items() if name not in ("kind", "mode"))
    if cell.kind == "needle":
        wrong = f"wrong (answered {result['answer']!r}, expected {result['expected']})"
        verdict = "correct" if result["correct"] else wrong
    else:
        recall = result["attention_mass_recall"]
        verdict = f"ppl {result['ppl']:.3f}" + ("" if recall is None else f", attention-mass recall {recall:.3f}")
    return f"{cell.kind} {cell.mode} {where}: {verdict}"


def markdown(data: dict, results: list[dict]) -> str:
    """The run as a short report: settings line, needle tables, perplexity and recall table."""
    settings, machine = data["settings"], data["machine"]
    needles = [result for result in results if result["kind"] == "needle"]
    perplexities = [result for result in results if result["kind"] == "ppl"]
    versions = ", ".join(f"{name} {version}" for name, version in machine["versions"].items())
    lines = [
        f"# Accuracy: {settings['model']}, every KV mode against dense", "",
        f"Corpus {settings['corpus']['name']} ({settings['corpus']['license']}, {settings['corpus']['source']}). "
        f"Budgets per cell: host {settings['host_share']:.0%} of the context's KV, device "
        f"{settings['device_share']:.0%} (at least {settings['min_device_tokens']} tokens); alpha {settings['alpha']}, "
        f"beta {settings['beta']}; seeds (repeats) {data['grid']['seeds']}. "
        f"KV file cache bypass: {settings['cache_bypass']}. Machine: {machine['cpu_cores']} cores "
        f"({machine['cpu_model']}), {format_size(machine['memory_bytes'] or 0)} memory, torch threads "
        f"{settings['torch_threads']}; {versions}.", "",
    ]
    if needles:
        lines += _needle_tables(needle_summary(needles), needles)
    if perplexities:
        lines += _perplexity_table(perplexity_summary(perplexities), perplexities)
    return "\n".join(lines) + "\n"


def _needle_tables(summary: dict, cells: list[dict]) -> list[str]:
    variants = sorted({cell["variant"] for cell in cells}, key=VARIANTS.index)
    lines = ["## Needle in a haystack (exact match)", "",
             f"| mode | all | {' | '.join(variants)} | retention vs dense | decode ms/token |",
             "|---|---|" + "---|" * len(variants) + "---|---|"]
    for mode, row in summary.items():
        timing = spread([cell["ms_per_token"] for cell in cells if cell["mode"] == mode])
        retention = "-" if row["retention"] is None else f"{row['retention']:.2f}"
        lines.append(f"| {mode} | {tally_text(row['all'])} | "
                     + " | ".join(tally_text(row["variants"][variant]) if variant in row["variants"] else "-"
                                  for variant in variants)
                     + f" | {retention} | {spread_text(timing, '.1f')} |")
    depths = sorted({cell["depth"] for cell in cells})
    lines += ["", "By context and depth (all variants and seeds):", "",
              "| mode | context | " + " | ".join(f"depth {depth}" for depth in depths) + " |",
              "|---|---|" + "---|" * len(depths)]
    for mode, row in summary.items():
        for context, by_depth in sorted(row["grid"].items()):
            lines.append(f"| {mode} | {context} | "
                         + " | ".join(tally_text(by_depth[depth]) if depth in by_depth else "-" for depth in depths)
                         + " |")
    return lines + [""]


def _perplexity_table(summary: dict, cells: list[dict]) -> list[str]:
    steps = {(cell["mode"], cell["context"]): cell["tokens"] for cell in cells}  # runs may differ (--ppl-tokens)
    lines = ["## Perplexity and attention-mass recall (teacher-forced decode steps)", "",
             "| mode | context | steps | ppl | ppl - dense ppl | attention-mass recall | estimated mass's MAE |",
             "|---|---|---|---|---|---|---|"]
    for mode, by_context in summary.items():
        for context, row in by_context.items():
            values = (spread_text(row["ppl"], ".3f"), spread_text(row["ppl_delta"], "+.3f"),
                      spread_text(row["attention_mass_recall"], ".4f"),
                      spread_text(row.get("mass_estimate_mae"), ".4f"))
            lines.append(f"| {mode} | {context} | {steps[mode, context]} | {' | '.join(values)} |")
    return lines + ["", "Values are medians [min, max] over seeds (n = seeds)."]
