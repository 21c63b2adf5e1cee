"""`kvtier bench store`: time to first token of a document's first question vs a second one in a fresh process.

Each repeat empties a store, asks question one (a cold prefill that publishes the
document) and then question two, each as its own `kvtier generate` process, so
nothing but the store carries over. The store's records are read with O_DIRECT
(the result says whether the filesystem allowed it). Writes
bench/results/store-<model>-<context>.json and .md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtier.commands.bench_options import check_writable
from kvtier.commands.kv_options import add_dtype_option, add_model_option
from kvtier.data.corpus import CORPUS_NAMES
from kvtier.errors import ConfigError
from kvtier.eval.sparse.store_bench import MODES, StoreBench, run_store_benchmark, write_results


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("store")
    add_model_option(parser)
    add_dtype_option(parser)
    parser.add_argument("--context", type=int, default=8000, help="document tokens (default %(default)s)")
    parser.add_argument("--kv", default="dense", help=f"comma-separated KV modes of {', '.join(MODES)} (default dense)")
    parser.add_argument("--repeats", type=int, default=3, help="first/second question pairs per mode")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--corpus", choices=("auto", *CORPUS_NAMES), default="auto", help="text of the document")
    parser.add_argument("--kv-store", type=Path, default=None,
                        help="store directory, emptied before each pair (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results directory")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    modes = [mode.strip() for mode in args.kv.split(",") if mode.strip()]
    unknown = set(modes) - set(MODES)
    if unknown or args.repeats < 1:
        raise ConfigError(f"--kv takes {', '.join(MODES)} (comma-separated), --repeats at least 1")
    check_writable(args.out)
    from kvtier.models.loader import load_model  # only now: torch takes seconds, the options are checked first

    llm = load_model(args.model, dtype=args.dtype)  # its tokenizer cuts the document; each question loads its own
    bench = StoreBench(args.model, args.dtype, args.context, args.new_tokens, args.repeats, args.corpus)
    write_results(run_store_benchmark(llm, bench, modes, args.kv_store), args.out)
    return 0
