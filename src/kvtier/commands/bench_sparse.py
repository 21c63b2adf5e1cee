"""`kvtier bench sparse`: decode speed of `--kv sparse` side by side with `--kv offload`, plus selection quality.

One run, same prompt, same budgets (kvtier.eval.accuracy.budgets, as the other benchmarks):
the host budget defaults to 40% of the prompt's KV so that more than half of it
lives in the storage tier; the device budget is 2% of it, at least 128 tokens. Reports
per mode decode ms/token and disk bytes per step; for the sparse path the
step breakdown (scoring, fetch, attention, migration, rest of the model),
cold selection rate, K/V pages read per step, migrations and ping-pong rate
(per policy), APP's predicted vs measured T_CPU/T_storage, the scorer's
round-trip time; and the recall of the selected set against exact top-k for
sum/max head aggregation at full precision, INT8 and INT4.

A `dense` row (every token in memory, full attention) shows what removing all KV I/O gains over
offload on the machine: the room a tiered mode has. Prefill runs on every core; decode on one
core fewer for the sparse path, whose scorer process holds a core (one thread on 2 cores), and on
every core for dense and offload (kvtier.sparse.threads).

The model runs over the prompt once (kvtier.eval.sparse.prefill_tape): every mode prefills densely, so
each mode's cache is fed the recorded K/V of all but the prompt's last chunk, and that chunk runs
through the model in each mode. Only decode steps are compared; a mode's `prefill_s` is its
replay plus that chunk, and `prefill.record_s` the one real prefill. The recorded rows go to the
document KV store (`--kv-store`, as `kvtier generate`'s prompts do), and a rerun over the same
prompt reads them back, verified, instead of prefilling again (kvtier.eval.sparse.stored_rows;
`--no-kv-store` neither reads nor stores them).

Cold reads are honest: the sparse cold pool and the offload KV file are read
with O_DIRECT (the result says so; on a filesystem without O_DIRECT the
files are read buffered and the result records `direct: false`).
Writes JSON and markdown under `--out` (default bench/results/).

`--corpora paul-graham,code,...` runs the whole comparison over each corpus in turn (its own files, the corpus name
ending their stem) and adds one table of every corpus and mode (kvtier.eval.sparse.corpora_table), with the medians
of every 16 steps of the median round: over a long decode (`--new-tokens 128`) they show whether the step drifts.
"""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path

from kvtier.commands.bench_options import add_device_options, check_writable, corpus_list, storage_directory
from kvtier.commands.kv_options import add_dtype_option, add_model_option
from kvtier.commands.store_options import add_store_options, store_from
from kvtier.data.corpus import CORPUS_NAMES
from kvtier.sparse import SCORE_BITS, SparseSettings


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("sparse")
    add_model_option(parser)
    add_dtype_option(parser)
    add_device_options(parser, "the model and the device window live (the hot pool stays in pinned host DRAM, "
                               "the scorer beside the disk)")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens per sequence")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=16, help="decode steps timed per mode and repeat")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of every mode, alternating (dense, offload, sparse, dense, ...): the machine's "
                             "speed drifts, so ratios are taken within a round")
    parser.add_argument("--alpha", type=float, default=0.2)
    parser.add_argument("--score-bits", type=int, choices=SCORE_BITS, default=SparseSettings.score_bits,
                        help="key sketch precision (they draw up the cold shortlist)")
    parser.add_argument("--beta", default="auto")
    parser.add_argument("--host-share", type=float, default=0.4, help="host budget as a share of the prompt's KV")
    parser.add_argument("--policies", default="hit,naive", help="migration policies to run the sparse path with")
    parser.add_argument("--lookahead", choices=("on", "off", "both"), default="on",
                        help="run the sparse path with its lookahead, without it (rows '<mode>-no-lookahead'), or "
                             "both, alternating in each round")
    parser.add_argument("--top-p", type=float, default=None,
                        help="also run the sparse path with the adaptive budget at this attention mass (rows "
                             "'<mode>-top-p'), alternating in each round")
    parser.add_argument("--skip-offload", action="store_true")
    parser.add_argument("--skip-dense", action="store_true", help="skip the dense reference row (all KV in memory)")
    parser.add_argument("--corpus", choices=("auto", *CORPUS_NAMES), default="auto", help="text for prompts")
    parser.add_argument("--corpora", type=corpus_list, default=None, metavar="NAME,...",
                        help=f"run over each of these corpora in turn ({', '.join(CORPUS_NAMES)}) and add one table "
                             "of them all (sparse-corpora-*.md); replaces --corpus")
    parser.add_argument("--storage-dir", default=None)
    parser.add_argument("--prefill-chunk", type=int, default=1024)
    parser.add_argument("--recalibrate", action="store_true", help="measure APP's throughputs again")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    add_store_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_writable(args.out)
    storage_dir = str(storage_directory(args.storage_dir))
    store = store_from(args)
    import torch  # only now: torch takes seconds, the options are checked first

    from kvtier.eval.sparse.sparse_bench import SparseBench, run_sparse_benchmark, write_results
    from kvtier.models.loader import load_model
    from kvtier.sparse import machine_threads

    torch.set_num_threads(machine_threads())  # prefill everywhere; decode threads per mode (kvtier.sparse.threads)
    llm = load_model(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format)
    bench = SparseBench(**{field.name: getattr(args, field.name) for field in fields(SparseBench)})
    if args.corpora is None:
        write_results(run_sparse_benchmark(llm, bench, storage_dir, args.device, args.dtype, store), args.out)
        return 0
    from kvtier.eval.sparse.corpora_table import corpora_result, write_corpora_results

    results = {}
    for corpus in args.corpora:
        results[corpus] = run_sparse_benchmark(llm, replace(bench, corpus=corpus), storage_dir, args.device,
                                               args.dtype, store)
        write_results(results[corpus], args.out, suffix=f"-{corpus}")
    write_corpora_results(corpora_result(results), args.out)
    return 0
