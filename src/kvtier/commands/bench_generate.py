"""`kvtier bench generate`: the `kvtier generate` a user runs, per corpus, sparse vs offload vs dense.

Every run is the real command in a fresh process, over the same stored document with the same budgets; modes
alternate round by round and the page cache is dropped before each run where the process may (root on Linux).
Reports ms/token over the decode with the first passes apart, disk bytes per answer, the time to the first token and
whether the answer equals dense's (kvtier.eval.sparse.generate_bench says how). Writes
`generate-corpora-<model>-<context>.json` and `.md` under `--out` (default bench/results/).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kvtier.commands.bench_options import check_writable, corpus_list, storage_directory
from kvtier.commands.kv_options import add_dtype_option, add_model_option
from kvtier.commands.store_options import add_store_options, store_root
from kvtier.data.corpus import CORPUS_NAMES
from kvtier.errors import ConfigError
from kvtier.kv_config import KV_MODES
from kvtier.units import parse_size

QUESTION = "What is the text above about? Answer in one sentence."


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate")
    add_model_option(parser)
    add_dtype_option(parser)
    parser.add_argument("--context", type=int, default=8000, help="document tokens (default %(default)s)")
    parser.add_argument("--corpora", type=corpus_list, default=list(CORPUS_NAMES), metavar="NAME,...",
                        help=f"corpora to cut a document from, each in turn (default: {','.join(CORPUS_NAMES)})")
    parser.add_argument("--modes", type=_mode_list, default=["dense", "offload", "sparse"], metavar="KV,...",
                        help="KV modes, in the order each round runs them (default dense,offload,sparse); "
                        "sparse-auto: sparse with --alpha auto")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--device-kv-budget", type=_size, default="8MiB", help="of the tiered modes (default %(default)s)")
    parser.add_argument("--host-kv-budget", type=_size, default="48MiB", help="of the tiered modes (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of every mode (default %(default)s)")
    parser.add_argument("--first-steps", type=int, default=4,
                        help="decode passes at the start of the answer reported apart (default %(default)s)")
    parser.add_argument("--question", default=QUESTION, help="asked after each document")
    parser.add_argument("--storage-dir", default=None, help="directory for KV files (default: <user cache>/kvtier/kv)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    add_store_options(parser, reuse=False)
    parser.set_defaults(run=run)


def _size(value: str) -> str:
    """A budget as `kvtier generate` takes it, checked here so that a bad one fails before any run."""
    try:
        parse_size(value)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def _mode_list(value: str) -> list[str]:
    from kvtier.eval.sparse.generate_bench import VARIANTS

    known = [*KV_MODES, *VARIANTS]
    modes = [mode.strip() for mode in value.split(",") if mode.strip()]
    if not modes or len(set(modes)) != len(modes) or any(mode not in known for mode in modes):
        raise argparse.ArgumentTypeError(f"{value!r}: give distinct KV modes among {', '.join(known)}, "
                                         "separated by commas")
    return modes


def run(args: argparse.Namespace) -> int:
    for option in ("context", "max_new_tokens", "rounds"):
        if getattr(args, option) < 1:
            raise ConfigError(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    check_writable(args.out)
    from kvtier.eval.sparse.generate_bench import GenerateBench, run_generate_benchmark, write_documents
    from kvtier.eval.sparse.generate_table import write_results
    from kvtier.models.loader import load_model

    bench = GenerateBench(model=args.model, dtype=args.dtype, context=args.context, corpora=tuple(args.corpora),
                          modes=tuple(args.modes), max_new_tokens=args.max_new_tokens,
                          device_kv_budget=args.device_kv_budget, host_kv_budget=args.host_kv_budget,
                          rounds=args.rounds, first_steps=args.first_steps, question=args.question,
                          storage_dir=str(storage_directory(args.storage_dir)),
                          kv_store=str(store_root(args.kv_store)) if args.kv_store else None)
    tokenizer = load_model(args.model, dtype=args.dtype).tokenizer  # the documents are cut in the model's tokens
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-generate-") as directory:
        documents = write_documents(tokenizer, bench.corpora, bench.context, Path(directory))
        write_results(run_generate_benchmark(bench, documents, on_run=lambda line: print(line, file=sys.stderr)),
                      args.out)
    return 0
