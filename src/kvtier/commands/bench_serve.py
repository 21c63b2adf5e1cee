"""`kvtier bench serve`: the HiFC swap-path benchmark; writes bench/results/serve.json and serve.md.

`--scale` shrinks the full workload (32 requests of 2K-8K tokens, 128 new tokens, pool a
quarter of the demand): prompt lengths by the factor, the output length by the same factor down
to 32 tokens, keeping the 32 requests (default 1/32: 32 requests of 64-256 tokens, 32 new tokens
each; one engine run of smollm2-135m took 17-20 s on the 2-core VM at full speed, 6.6-10.6 min
while it was throttled). The default is scaled for a second reason, measured: at `--scale 1`
the flash run took 704 s and swapped nothing (0 swap-outs), because admission stops when the
next 2K-8K prompt does not fit and the room it leaves covers the running sequences' 128-token
growth; with short prompts and >= 32 new tokens, growth outruns the pool and forces swapping.

`--device cuda` runs the model and the KV pool on a GPU, where flash swap goes through kvikio
(engine/swap/gds.py); `--load-format dummy` gives the model random weights in its real architecture, for
GPU machines that hold a model's config and tokenizer but not its weights (bench/gpu/check.sh).

`add_parser` takes the sub-command group of `kvtier bench` (it adds `serve` to it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtier.commands.bench_options import add_device_options, add_flash_dir_option, flash_dir_from
from kvtier.commands.kv_options import add_dtype_option, add_model_option
from kvtier.eval.serving.workload import SWEEP_BLOCKS, Workload
from kvtier.units import parse_size

DEFAULT_SCALE = 1 / 32


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", description=__doc__.split("\n\n")[1])
    add_model_option(parser)
    add_dtype_option(parser)
    add_device_options(parser, "the model and the KV pool live (on a GPU, flash swap goes through kvikio)")
    parser.add_argument("--scale", type=float, default=DEFAULT_SCALE,
                        help="fraction of the full workload (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="flash/DRAM repeats for medians (default %(default)s)")
    parser.add_argument("--block-tokens", type=int, default=64, help="block size of the main comparison")
    parser.add_argument("--sweep", default=",".join(map(str, SWEEP_BLOCKS)),
                        help="block sizes of the sweep, comma-separated (default %(default)s; empty: none)")
    parser.add_argument("--no-extra-runs", dest="extra_runs", action="store_false",
                        help="skip the naive-allocator and recompute engine runs (flash vs DRAM only)")
    parser.add_argument("--io-threads", type=int, default=16, help="swap I/O threads (default %(default)s)")
    parser.add_argument("--init-size", default="1GiB", help="flash file / DRAM pool size for the init test")
    add_flash_dir_option(parser)
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results directory")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    flash_dir = flash_dir_from(args)
    sweep = tuple(int(value) for value in args.sweep.split(",") if value.strip())
    workload = Workload().scaled(args.scale)
    # only now: torch takes seconds, the options are checked first
    from kvtier.eval.serving.serve_bench import render_markdown, run_serve_benchmark
    from kvtier.models.loader import load_model

    llm = load_model(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    say(f"[bench serve] {llm.name}: {workload.requests} requests of {workload.min_prompt_tokens}-"
        f"{workload.max_prompt_tokens} tokens, {workload.new_tokens} new tokens each (scale {args.scale})")
    result = run_serve_benchmark(llm, workload, flash_dir, args.block_tokens, args.repeats, args.io_threads,
                                 parse_size(args.init_size), sweep, args.extra_runs, say)
    result = {"model": llm.name, "scale": args.scale, "device": args.device, "dtype": args.dtype,
              "load_format": args.load_format} | result
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "serve.md").write_text(render_markdown(result))
    say(f"flash/DRAM throughput {result['flash_vs_dram']:.3f}; wrote {args.out / 'serve.json'} and serve.md")
    return 0
