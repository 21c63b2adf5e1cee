"""`kvtier bench http`: `kvtier serve` under 1-64 streaming clients; writes bench/results/http.json and http.md.

Throughput, time to first token and inter-token latency (p50 / p99) per client count, flash vs
DRAM swap in the same run, and the server's throughput as a share of the offline engine's on the
same prompts (kvtier.eval.serving.http_bench explains the method). The device pool is small enough that the
higher client counts swap. Prompts are short generated sentences; every request asks for
--new-tokens tokens with ignore_eos, so every run generates the same number of tokens.

`add_parser` takes the sub-command group of `kvtier bench` (it adds `http` to it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtier.commands.bench_options import add_flash_dir_option, check_writable, flash_dir_from
from kvtier.commands.kv_options import add_dtype_option, add_model_option
from kvtier.errors import ConfigError
from kvtier.engine.config import EngineConfig
from kvtier.eval.serving.documents_workload import WORKLOADS, DocumentsWorkload

CLIENT_LEVELS = (1, 8, 32, 64)  # the concurrent client counts a run measures (--clients)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("http", description=__doc__.split("\n\n")[1])
    add_model_option(parser)
    add_dtype_option(parser)
    parser.add_argument("--clients", default=",".join(map(str, CLIENT_LEVELS)),
                        help="concurrent client counts, comma-separated (default %(default)s)")
    parser.add_argument("--requests-per-client", type=int, default=1, help="requests per client (default %(default)s)")
    parser.add_argument("--min-requests", type=int, default=8,
                        help="requests of a level at least (default %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="tokens per request (default 12; with --workload documents 64)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating repeats for medians (default %(default)s)")
    parser.add_argument("--block-tokens", type=int, default=16, help="engine block size (default %(default)s)")
    parser.add_argument("--device-blocks", type=int, default=48,
                        help="device pool blocks, small enough to swap at the higher levels (default %(default)s)")
    parser.add_argument("--swap-space", default="256MiB", help="flash file / DRAM pool size (default %(default)s)")
    add_flash_dir_option(parser)
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results directory")
    documents = parser.add_argument_group(
        "--workload documents: stored long documents' questions streamed at once, tiered vs one at a time vs paged "
        "(writes http-documents.json and .md; --new-tokens, --repeats and --block-tokens apply)")
    documents.add_argument("--workload", choices=WORKLOADS, default="short",
                           help="short prompts at each --clients level, or long documents (default %(default)s)")
    workload = DocumentsWorkload()
    documents.add_argument("--documents", type=int, default=workload.documents,
                           help="documents, two questions each (default %(default)s)")
    documents.add_argument("--document-tokens", type=int, default=workload.document_tokens,
                           help="tokens per document (default %(default)s)")
    documents.add_argument("--device-kv-budget", default=workload.device_kv_budget,
                           help="the engine's device KV budget (default %(default)s)")
    documents.add_argument("--host-kv-budget", default=workload.host_kv_budget,
                           help="the tiered sequences' host budget, over all of them (default %(default)s)")
    documents.add_argument("--max-tiered-seqs", type=int, default=workload.max_tiered_seqs,
                           help="tiered sequences at once (default %(default)s)")
    parser.set_defaults(run=run)
    return parser


SHORT_NEW_TOKENS = 12


def prompts(count: int) -> list[str]:
    """Short distinct prompts, the same every run."""
    topics = ["rivers", "bridges", "owls", "clocks", "volcanoes", "libraries", "comets", "violins"]
    return [f"Here is a short note about {topics[i % len(topics)]}, number {i}:" for i in range(count)]


def run(args: argparse.Namespace) -> int:
    if args.workload == "documents":
        args.new_tokens = DocumentsWorkload.new_tokens if args.new_tokens is None else args.new_tokens
        return run_documents(args)
    args.new_tokens = SHORT_NEW_TOKENS if args.new_tokens is None else args.new_tokens
    try:
        levels = tuple(int(value) for value in args.clients.split(",") if value.strip())
    except ValueError:
        raise ConfigError(f"--clients wants comma-separated integers, got {args.clients!r}") from None
    if not levels or min(levels) < 1 or min(args.new_tokens, args.repeats, args.requests_per_client) < 1:
        raise ConfigError("--clients, --new-tokens, --repeats and --requests-per-client must be positive")
    check_writable(args.out)
    flash_dir = flash_dir_from(args)
    config = EngineConfig(block_tokens=args.block_tokens, device_blocks=args.device_blocks,
                          swap_space=args.swap_space, flash_path=str(flash_dir / "bench-http.kvc"),
                          max_num_seqs=max(levels)).validated()
    # only now: torch takes seconds, the options are checked first
    from kvtier.eval.serving.http_bench import render_markdown, requests_for, run_http_benchmark
    from kvtier.models.loader import load_model

    llm = load_model(args.model, dtype=args.dtype)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    count = requests_for(max(levels), args.requests_per_client, args.min_requests)
    result = run_http_benchmark(llm, prompts(count), config, levels, args.requests_per_client, args.min_requests,
                                args.new_tokens, args.repeats, say)
    result = {"model": llm.name, "dtype": args.dtype,
              "command": command_line(args)} | result
    (args.out / "http.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "http.md").write_text(render_markdown(result))
    say(f"wrote {args.out / 'http.json'} and http.md")
    return 0


def command_line(args: argparse.Namespace) -> str:
    """The run's settings as the command that repeats it (the flash directory aside)."""
    return (f"kvtier bench http --model {args.model} --dtype {args.dtype} --clients {args.clients} "
            f"--requests-per-client {args.requests_per_client} --min-requests {args.min_requests} "
            f"--new-tokens {args.new_tokens} --repeats {args.repeats} --block-tokens {args.block_tokens} "
            f"--device-blocks {args.device_blocks} --swap-space {args.swap_space}")


def run_documents(args: argparse.Namespace) -> int:
    """`--workload documents` (kvtier.eval.serving.documents_bench explains the method)."""
    if min(args.documents, args.document_tokens, args.new_tokens, args.repeats, args.max_tiered_seqs) < 1:
        raise ConfigError("--documents, --document-tokens, --new-tokens, --repeats and --max-tiered-seqs must be "
                          "positive")
    check_writable(args.out)
    workload = DocumentsWorkload(args.documents, args.document_tokens, args.new_tokens, args.device_kv_budget,
                                 args.host_kv_budget, args.max_tiered_seqs, args.repeats)
    base = EngineConfig(block_tokens=args.block_tokens, swap_space=args.swap_space).validated()
    # only now: torch takes seconds, the options are checked first
    from kvtier.eval.serving.documents_bench import render_documents_markdown, run_documents_benchmark
    from kvtier.models.loader import load_model

    llm = load_model(args.model, dtype=args.dtype)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    result = run_documents_benchmark(llm, workload, base, flash_dir_from(args), say)
    result = {"model": llm.name, "dtype": args.dtype, "command": documents_command_line(args)} | result
    (args.out / "http-documents.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "http-documents.md").write_text(render_documents_markdown(result))
    say(f"wrote {args.out / 'http-documents.json'} and http-documents.md")
    return 0


def documents_command_line(args: argparse.Namespace) -> str:
    return (f"kvtier bench http --workload documents --model {args.model} --dtype {args.dtype} "
            f"--documents {args.documents} --document-tokens {args.document_tokens} --new-tokens {args.new_tokens} "
            f"--repeats {args.repeats} --block-tokens {args.block_tokens} --swap-space {args.swap_space} "
            f"--device-kv-budget {args.device_kv_budget} --host-kv-budget {args.host_kv_budget} "
            f"--max-tiered-seqs {args.max_tiered_seqs}")
