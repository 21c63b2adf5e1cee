"""`kvtier bench ruler`: a RULER-style task suite asked of every KV mode at equal budgets, scored against dense.

Tasks (generated offline from the packaged corpora, deterministic by seed; kvtier.data.ruler):
  retrieval     niah_single_essay, niah_single_noise, niah_single_random (one needle in essay text, repeated
                noise sentences, random-token strings), niah_multikey (four keys, one asked), niah_multivalue
                (four values of one key), niah_multiquery (four keys asked)
  multi-hop     vt: variable tracking, a chain of four assignments in noise
  aggregation   cwe: the ten most common words of a numbered list; fwe: the three most frequent coded words
RULER's question answering is left out: no registry package ships a QA data set with its documents.

Each answer is greedy and scored as RULER scores it: the share of the expected strings it names.
Retention = a mode's summed score / dense's over the same cells, per family and over all.

Modes (one table, kvtier.eval.accuracy.ruler_grid.SUITE_MODES): dense; offload (a check: its tokens must equal
dense's, the run stops with an error if not); sparse at alpha 0.2 and 0.1, and with the adaptive budget
(sparse-p0.9 and sparse-p0.95: top-p at those masses); h2o, infinigen, leoam and quest at alpha 0.2. Every mode
gets the same budgets per cell (shares of the context's KV, as `bench accuracy`: host 40%, device 2% with a
128-token floor) and attends the same share of its pooled tokens, but the top-p modes: what their budget finds.

Contexts (prompt and answer tokens): 2048,4096,8192 for smollm2-135m; 4096,8192,16384 for qwen2.5-0.5b;
--samples 8 per task and context (sample i: seed i). Each sample's prompt is prefilled densely once and
replayed, queries included, into every mode's cache. Results: `<out>/ruler-<model>.json` (one entry per
cell, written as each finishes: a rerun skips finished cells, `--force` reruns) and `ruler-<model>.md`;
the plot `<out>/plots/ruler-<model>.png` (retention per family per mode) is drawn when matplotlib is
installed, and `kvtier bench report` links it from REPORT.md. A progress line per cell goes to stderr.
Long grids: run them in pieces with --contexts, --tasks and --modes; finished cells are kept.
"""

from __future__ import annotations

import argparse

from kvtier.commands.bench_options import add_run_options, check_writable, names_from, shares_from, storage_directory
from kvtier.commands.kv_options import add_model_option
from kvtier.data.ruler import TASKS
from kvtier.errors import ConfigError
from kvtier.eval.accuracy.ruler_grid import SAMPLES, SUITE_MODES, default_contexts
from kvtier.kv_config import KVConfig


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("ruler", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser)
    parser.add_argument("--modes", default=None, help=f"comma-separated suite modes among {','.join(SUITE_MODES)} "
                                                      "(default: all)")
    parser.add_argument("--tasks", default=None, help=f"comma-separated tasks among {','.join(TASKS)} (default: all)")
    parser.add_argument("--contexts", default=None, help="prompt + answer tokens, e.g. 2048,4096 (default: the "
                                                         "model's three)")
    parser.add_argument("--samples", type=int, default=SAMPLES, help="samples per task and context (default %(default)s)")
    parser.add_argument("--beta", default=KVConfig.beta, help="sparse hot/cold split, or 'auto' (calibrated)")
    add_run_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    modes = names_from(args.modes, tuple(SUITE_MODES), "suite mode") if args.modes else tuple(SUITE_MODES)
    tasks = names_from(args.tasks, tuple(TASKS), "task") if args.tasks else tuple(TASKS)
    contexts = _contexts(args.contexts)
    if args.samples < 1:
        raise ConfigError(f"--samples must be at least 1, got {args.samples}")
    shares = shares_from(args)
    check_writable(args.out)
    storage_dir = storage_directory(args.storage_dir)
    import torch  # only now: torch takes seconds, the options are checked first

    from kvtier.eval.accuracy.ruler_bench import RulerOptions, run_ruler
    from kvtier.eval.report.markdown_report import PLOTS_DIR, read_json, ruler_plot
    from kvtier.models.loader import load_model

    torch.set_num_threads(1)  # the sparse scorer process needs the other core
    llm = load_model(args.model)
    results = run_ruler(llm, list(tasks), contexts or default_contexts(llm.name), args.samples, list(modes), shares,
                        RulerOptions(args.corpus, args.beta, storage_dir, args.out, args.force))
    try:
        ruler_plot(args.out / PLOTS_DIR / f"{results.stem}.png", read_json(results))
    except ConfigError as missing:  # matplotlib is optional: the results stand without their plot
        print(f"kvtier: no plot drawn: {missing}")
    return 0


def _contexts(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        contexts = tuple(int(value) for value in text.split(","))
    except ValueError:
        raise ConfigError(f"--contexts takes comma-separated token counts, got {text!r}") from None
    if any(context < 256 for context in contexts):
        raise ConfigError(f"--contexts must be at least 256 tokens each, got {text}")
    return contexts
