"""`kvtier bench latency`: the HillInfer latency experiments (a-f) for every KV mode; JSON per experiment.

Experiments (kvtier.eval.sparse.latency_grid): a) decode latency vs context length; b) batch-size
scaling at 1920 input + 128 output tokens and a stress run at batch 20-25; c) ablation:
prefetch baseline (infinigen), sparse without migration, +HKM, +HKM+APP; d) beta sweep
next to APP's beta; e) alpha sweep, latency and needle accuracy; f) bytes moved per decode
step per tier and direction. Every mode is timed by the same loop (prefill, one untimed
step, then the timed greedy steps); each cell is repeated (`--repeats`) with a fresh cache
and reported as median [min, max]. Budgets per sequence: host `--host-share` of the
prompt's KV (d: all of it), device `--device-share` with a 128-token floor. KV files are
read with O_DIRECT (each cell records its cache bypass).

Results: `<out>/latency-<experiment>-<model>-<grid>.json` (machine, versions, settings, one
entry per cell); finished cells are skipped on a re-run (`--force` reruns them). Then
`kvtier bench report` writes REPORT.md and the plots.

Grids (2 cores; torch threads per phase and mode as kvtier.sparse.threads; times for an idle machine):
  small (default): smollm2-135m; a) 1K, 2K, 4K; b) batch 1, 2, 4 and a stress run at 20
      (once), 16 output tokens; c-f at 2K; 8 timed steps; 3 repeats. With six modes: about
      0.9M prompt tokens and 2.4K decode steps, roughly 30-40 minutes.
  full: qwen2.5-0.5b; a) 2K-32K (the last 32512: room for the steps); b) batch 1-10 and 20-25
      with 128 output tokens; c) batch 8; c-f at 8K; 32 timed steps; 3 repeats. With six
      modes: about 12.5M prompt tokens and 44K decode steps, roughly a day (prefill ~280
      tok/s at 2K, slower at 32K). Run it experiment by experiment (`--experiments b`);
      finished cells are kept.
Each experiment prints its pending prompt tokens and decode steps before it starts.
Options given explicitly (`--contexts`, `--batches`, ...) replace the grid's values.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from kvtier.commands.bench_options import add_run_options, check_writable, storage_directory
from kvtier.data.corpus import load_corpus
from kvtier.errors import ConfigError
from kvtier.eval.accuracy.corpus_slice import CHARS_PER_TOKEN_BOUND, STRIDE_CHARS
from kvtier.eval.sparse.latency_grid import EXPERIMENTS, GRIDS, Grid, experiment_cells, parse_experiments, parse_modes

LIST_OPTIONS = {"contexts": int, "batches": int, "stress_batches": int, "betas": float, "alphas": float}
NUMBER_OPTIONS = ("new_tokens", "fixed_context", "fixed_beta")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("latency", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model name or path (default: the grid's)")
    parser.add_argument("--experiments", default=",".join(EXPERIMENTS),
                        help="comma-separated letters or names: " +
                             ", ".join(f"{e.letter}={e.name}" for e in EXPERIMENTS.values()))
    parser.add_argument("--modes", default=None, help="comma-separated KV modes for a, b, e, f (default: all)")
    parser.add_argument("--grid", choices=tuple(GRIDS), default="small", help="preset sizes (default small)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell for medians (default 3)")
    parser.add_argument("--new-tokens", type=int, default=None, help="timed decode steps per run (b: output tokens)")
    parser.add_argument("--contexts", default=None, help="a: prompt tokens, e.g. 1024,2048")
    parser.add_argument("--fixed-context", type=int, default=None, help="prompt tokens of c, d, e, f")
    parser.add_argument("--batches", default=None, help="b: batch sizes, e.g. 1,2,4")
    parser.add_argument("--stress-batches", default=None, help="b: stress batch sizes, e.g. 20,25")
    parser.add_argument("--betas", default=None, help="d: fixed betas, e.g. 0.5,1,2")
    parser.add_argument("--alphas", default=None, help="e: importance rates, e.g. 0.05,0.1,0.2")
    parser.add_argument("--fixed-beta", type=float, default=None, help="c: +HKM's beta (default alpha/(1-alpha))")
    add_run_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    grid = grid_from(args)
    letters, modes = parse_experiments(args.experiments), parse_modes(args.modes)
    if args.repeats < 1 or not 0 < args.host_share <= 1 or not 0 <= args.device_share <= 1:
        raise ConfigError("--repeats must be >= 1, --host-share in (0, 1] and --device-share in [0, 1]")
    check_writable(args.out)
    storage_dir = storage_directory(args.storage_dir)
    cells = {letter: experiment_cells(letter, grid, modes, args.repeats, args.host_share) for letter in letters}
    import torch  # only now: torch takes seconds, the options are checked first

    from kvtier.eval.sparse.latency import RunOptions, check_contexts, run_experiment
    from kvtier.models.loader import load_model
    from kvtier.sparse import machine_threads

    torch.set_num_threads(machine_threads())  # prefill everywhere; decode threads per mode (kvtier.sparse.threads)
    llm = load_model(args.model or grid.model)
    check_contexts(llm, [cell for group in cells.values() for cell in group])
    longest = max(cell.context for group in cells.values() for cell in group)
    corpus = load_corpus(args.corpus, min_chars=CHARS_PER_TOKEN_BOUND * longest + STRIDE_CHARS, progress=False)
    options = RunOptions(str(storage_dir), corpus.text, args.device_share)
    settings = {"model": llm.name, "grid": grid.name, "repeats": args.repeats, "host_share": args.host_share,
                "alpha": grid.alpha, "corpus": {"name": corpus.name, "license": corpus.license,
                                                "source": corpus.source}} | options.as_settings()
    for letter in letters:
        run_experiment(llm, letter, cells[letter], settings, options, args.out, args.force)
    print(f"next: `kvtier bench report --results {args.out}` writes REPORT.md and the plots")
    return 0


def grid_from(args: argparse.Namespace) -> Grid:
    """The preset grid with the explicitly given options replacing its values."""
    grid = GRIDS[args.grid]
    changes = {name: _numbers(getattr(args, name), kind, name) for name, kind in LIST_OPTIONS.items()
               if getattr(args, name) is not None}
    changes |= {name: getattr(args, name) for name in NUMBER_OPTIONS if getattr(args, name) is not None}
    if args.new_tokens is not None:
        changes["batch_output"] = args.new_tokens
    grid = replace(grid, **changes)
    sizes = (*grid.contexts, *grid.batches, *grid.stress_batches, grid.fixed_context, grid.new_tokens)
    if min(sizes) < 1 or min(grid.betas, default=0) < 0 or not all(0 < alpha <= 1 for alpha in grid.alphas):
        raise ConfigError("contexts, batches and --new-tokens must be >= 1, betas >= 0 and alphas in (0, 1]")
    return grid


def _numbers(text: str, kind: type, name: str) -> tuple:
    try:
        values = tuple(kind(value) for value in text.split(",") if value.strip())
    except ValueError:
        values = ()
    if not values:
        raise ConfigError(f"--{name.replace('_', '-')} takes comma-separated numbers, got {text!r}")
    return values
