"""`kvtier bench http`: `kvtier serve` under 1-64 streaming clients; writes bench/results/http.json and http.md.

Throughput, time to first token and inter-token latency (p50 / p99) per client count, flash vs
DRAM swap in the same run, and the server's throughput as a share of the offline engine's on the
same prompts (kvtier.eval.serving.http_bench explains the method). The device pool is small enough that the
higher client counts swap. Prompts are short generated sentences; every request asks for
--new-tokens tokens with ignore_eos, so every run generates the same number of tokens.
`--workload random`: 48 prompts of 384 random tokens, 48 new tokens each, 16 clients, the engine's
default budgets, for each --max-batched-tokens in turn: the tails (p99 / p50) of time to first token and
inter-token latency (http-random.json and .md). `--workload documents`: see its option group.
`--sampling-fields`: the short workload sampled at temperature 1 without and with those request fields
(what sampling on the logits costs; http-sampling.json and .md).

`add_parser` takes the sub-command group of `kvtier bench` (it adds `http` to it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace
from pathlib import Path

from kvtier.commands.bench_options import add_device_options, add_flash_dir_option, check_writable, flash_dir_from
from kvtier.commands.kv_options import add_dtype_option, add_model_option
from kvtier.errors import ConfigError
from kvtier.engine.config import EngineConfig
from kvtier.eval.serving.documents_workload import DocumentsWorkload

WORKLOADS = ("short", "documents", "random")
# The defaults of the options a workload reads, where the command line leaves them unset.
PRESETS = {
    "short": {"clients": "1,8,32,64", "min_requests": 8, "new_tokens": 12, "block_tokens": 16, "device_blocks": 48},
    "documents": {"new_tokens": DocumentsWorkload.new_tokens, "block_tokens": 16,
                  "device_kv_budget": DocumentsWorkload.device_kv_budget},
    "random": {"clients": "16", "min_requests": 48, "new_tokens": 48, "block_tokens": EngineConfig.block_tokens,
               "device_kv_budget": EngineConfig.device_kv_budget},
}
RANDOM_PROMPT_TOKENS = 384
RANDOM_STEP_TOKENS = "512,128"  # the engine's default per-step token budget, and one that bounds the tails on a CPU
SAMPLED_TEMPERATURE = 1.0  # --sampling-fields: the plain sampling they are compared with


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("http", description=__doc__.split("\n\n")[1])
    add_model_option(parser)
    add_dtype_option(parser)
    add_device_options(parser, "the model and the KV pool live (tiered sequences' windows too)")
    parser.add_argument("--workload", choices=WORKLOADS, default="short",
                        help="short prompts at each --clients level, long stored documents, or random 384-token "
                             "prompts for the latency tails (default %(default)s)")
    parser.add_argument("--clients", default=None,
                        help="concurrent client counts, comma-separated (default 1,8,32,64; random: 16)")
    parser.add_argument("--requests-per-client", type=int, default=1, help="requests per client (default %(default)s)")
    parser.add_argument("--min-requests", type=int, default=None,
                        help="requests of a level at least (default 8; random: 48)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="tokens per request (default 12; documents: 64; random: 48)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating repeats for medians (default %(default)s)")
    parser.add_argument("--block-tokens", type=int, default=None,
                        help="engine block size (default 16; random: the engine's, 64)")
    parser.add_argument("--device-blocks", type=int, default=None,
                        help="device pool blocks, small enough to swap at the higher levels (default 48; random: "
                             "--device-kv-budget)")
    parser.add_argument("--device-kv-budget", default=None,
                        help="the engine's device KV budget (documents: 64MiB; random: the engine's, 256MiB)")
    parser.add_argument("--max-batched-tokens", default=RANDOM_STEP_TOKENS,
                        help="random: the engine's per-step token budgets compared, comma-separated (default "
                             "%(default)s)")
    parser.add_argument("--swap-space", default="256MiB", help="flash file / DRAM pool size (default %(default)s)")
    parser.add_argument("--sampling-fields", default=None, metavar="JSON",
                        help="short workload: instead of flash vs DRAM, compare sampling at temperature 1 without and "
                             "with these request fields (vLLM's names, e.g. '{\"repetition_penalty\": 1.1, "
                             "\"top_k\": 50, \"min_p\": 0.05}'), flash swap, in one run (http-sampling.json, .md)")
    add_flash_dir_option(parser)
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results directory")
    documents = parser.add_argument_group(
        "--workload documents: stored long documents' questions streamed at once, tiered vs one at a time vs paged "
        "(writes http-documents.json and .md; --new-tokens, --repeats, --block-tokens and --device-kv-budget apply)")
    workload = DocumentsWorkload()
    documents.add_argument("--documents", type=int, default=workload.documents,
                           help="documents, two questions each (default %(default)s)")
    documents.add_argument("--document-tokens", type=int, default=workload.document_tokens,
                           help="tokens per document (default %(default)s)")
    documents.add_argument("--host-kv-budget", default=workload.host_kv_budget,
                           help="the tiered sequences' host budget, over all of them (default %(default)s)")
    documents.add_argument("--max-tiered-seqs", type=int, default=workload.max_tiered_seqs,
                           help="tiered sequences at once (default %(default)s)")
    documents.add_argument("--tiered-slice", type=int, default=workload.tiered_slice,
                           help="the sliced server's tokens before a tiered sequence yields its share "
                                "(default %(default)s)")
    parser.set_defaults(run=run)
    return parser


def prompts(count: int) -> list[str]:
    """Short distinct prompts, the same every run."""
    topics = ["rivers", "bridges", "owls", "clocks", "volcanoes", "libraries", "comets", "violins"]
    return [f"Here is a short note about {topics[i % len(topics)]}, number {i}:" for i in range(count)]


def random_prompts(tokenizer, count: int, tokens: int, seed: int = 0) -> list[str]:
    """`count` texts of `tokens` random tokens each (about as many once tokenized again), the same every run."""
    generator = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    ordinary = [token for token in range(tokenizer.vocab_size) if token not in special]
    return [tokenizer.decode([generator.choice(ordinary) for _ in range(tokens)]) for _ in range(count)]


def run(args: argparse.Namespace) -> int:
    if args.sampling_fields is not None and args.workload != "short":
        raise ConfigError("--sampling-fields is for the short workload")
    for name, value in PRESETS[args.workload].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.workload == "documents":
        return run_documents(args)
    levels = _positive_integers(args.clients, "--clients")
    if min(args.new_tokens, args.repeats, args.requests_per_client) < 1:
        raise ConfigError("--new-tokens, --repeats and --requests-per-client must be positive")
    sampling = sampling_fields(args.sampling_fields)
    if args.workload == "random":
        return run_random(args, levels)
    check_writable(args.out)
    flash_dir = flash_dir_from(args)
    config = EngineConfig(block_tokens=args.block_tokens, device_blocks=args.device_blocks,
                          swap_space=args.swap_space, flash_path=str(flash_dir / "bench-http.kvc"),
                          max_num_seqs=max(levels)).validated()
    # only now: torch takes seconds, the options are checked first
    from kvtier.eval.serving.http_bench import render_markdown, requests_for, run_http_benchmark

    llm = _load(args)
    count = requests_for(max(levels), args.requests_per_client, args.min_requests)
    result = run_http_benchmark(llm, prompts(count), config, levels, args.requests_per_client, args.min_requests,
                                args.new_tokens, args.repeats, _say, *sampled_setups(config, sampling))
    stem = "http-sampling" if sampling else "http"
    return _write(args, stem, llm, {"command": command_line(args)} | result, render_markdown)


def sampling_fields(text: str | None) -> dict | None:
    """--sampling-fields as request fields, checked as the server checks them (ConfigError naming the bad one)."""
    if text is None:
        return None
    from kvtier.engine.sampling_params import SamplingParams  # no torch: checked before the model loads

    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--sampling-fields is not JSON: {error.msg}") from None
    if not isinstance(fields, dict) or not fields:
        raise ConfigError("--sampling-fields wants a JSON object of request fields, e.g. '{\"top_k\": 50}'")
    try:
        SamplingParams(temperature=SAMPLED_TEMPERATURE, **fields)
    except TypeError:
        raise ConfigError(f"--sampling-fields: only sampling fields, got {', '.join(fields)}") from None
    return fields


def sampled_setups(config: EngineConfig, fields: dict | None) -> tuple[dict | None, dict | None]:
    """The setups and their request fields for run_http_benchmark: temperature-1 sampling without and with `fields`
    on `config` with flash swap; (None, None) without fields (flash vs DRAM, greedy)."""
    if not fields:
        return None, None
    plain = f"temperature {SAMPLED_TEMPERATURE:g}"
    names = (plain, f"{plain} + {', '.join(fields)}")
    flash = replace(config, swap="flash")
    base = {"temperature": SAMPLED_TEMPERATURE}
    return {name: flash for name in names}, {names[0]: base, names[1]: base | fields}


def command_line(args: argparse.Namespace) -> str:
    """The run's settings as the command that repeats it (the flash directory aside)."""
    pool = f"--device-blocks {args.device_blocks}" if args.device_blocks else f"--device-kv-budget {args.device_kv_budget}"
    steps = f" --max-batched-tokens {args.max_batched_tokens}" if args.workload == "random" else ""
    return (f"kvtier bench http --workload {args.workload} --model {args.model} --dtype {args.dtype} "
            f"--clients {args.clients} --requests-per-client {args.requests_per_client} "
            f"--min-requests {args.min_requests} --new-tokens {args.new_tokens} --repeats {args.repeats} "
            f"--block-tokens {args.block_tokens} {pool} --swap-space {args.swap_space}{steps}{_placement(args)}"
            + (f" --sampling-fields '{args.sampling_fields}'" if getattr(args, "sampling_fields", None) else ""))


def run_documents(args: argparse.Namespace) -> int:
    """`--workload documents` (kvtier.eval.serving.documents_bench explains the method)."""
    if min(args.documents, args.document_tokens, args.new_tokens, args.repeats, args.max_tiered_seqs,
           args.tiered_slice) < 1:
        raise ConfigError("--documents, --document-tokens, --new-tokens, --repeats, --max-tiered-seqs and "
                          "--tiered-slice must be positive")
    check_writable(args.out)
    workload = DocumentsWorkload(args.documents, args.document_tokens, args.new_tokens, args.device_kv_budget,
                                 args.host_kv_budget, args.max_tiered_seqs, args.repeats, args.tiered_slice)
    base = EngineConfig(block_tokens=args.block_tokens, swap_space=args.swap_space).validated()
    # only now: torch takes seconds, the options are checked first
    from kvtier.eval.serving.documents_bench import render_documents_markdown, run_documents_benchmark

    llm = _load(args)
    result = run_documents_benchmark(llm, workload, base, flash_dir_from(args), _say)
    return _write(args, "http-documents", llm, {"command": documents_command_line(args)} | result,
                  render_documents_markdown)


def documents_command_line(args: argparse.Namespace) -> str:
    return (f"kvtier bench http --workload documents --model {args.model} --dtype {args.dtype} "
            f"--documents {args.documents} --document-tokens {args.document_tokens} --new-tokens {args.new_tokens} "
            f"--repeats {args.repeats} --block-tokens {args.block_tokens} --swap-space {args.swap_space} "
            f"--device-kv-budget {args.device_kv_budget} --host-kv-budget {args.host_kv_budget} "
            f"--max-tiered-seqs {args.max_tiered_seqs} --tiered-slice {args.tiered_slice}{_placement(args)}")


def run_random(args: argparse.Namespace, levels: tuple[int, ...]) -> int:
    """`--workload random`: the same random prompts through the server at each per-step token budget."""
    budgets = _positive_integers(args.max_batched_tokens, "--max-batched-tokens")
    check_writable(args.out)
    config = EngineConfig(block_tokens=args.block_tokens, device_kv_budget=args.device_kv_budget,
                          device_blocks=args.device_blocks, swap_space=args.swap_space,
                          flash_path=str(flash_dir_from(args) / "bench-http.kvc"), max_num_seqs=max(levels)).validated()
    setups = {f"{budget} tokens per step": replace(config, max_batched_tokens=budget) for budget in budgets}
    # only now: torch takes seconds, the options are checked first
    from kvtier.eval.serving.http_bench import render_markdown, requests_for, run_http_benchmark

    llm = _load(args)
    count = requests_for(max(levels), args.requests_per_client, args.min_requests)
    result = run_http_benchmark(llm, random_prompts(llm.tokenizer, count, RANDOM_PROMPT_TOKENS), config, levels,
                                args.requests_per_client, args.min_requests, args.new_tokens, args.repeats, _say,
                                setups)
    return _write(args, "http-random", llm,
                  {"prompt_tokens": RANDOM_PROMPT_TOKENS, "command": command_line(args)} | result, render_markdown)


def _load(args: argparse.Namespace):
    """The model to serve; called once the options are checked (importing the loader takes torch: seconds)."""
    from kvtier.models.loader import load_model

    return load_model(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _write(args: argparse.Namespace, stem: str, llm, result: dict, render) -> int:
    """`result`, with the model and where it ran, as `<stem>.json` and `render(result)` as `<stem>.md` in --out."""
    result = {"model": llm.name, "dtype": args.dtype, "device": args.device} | result
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(render(result))
    _say(f"wrote {args.out / stem}.json and {stem}.md")
    return 0


def _placement(args: argparse.Namespace) -> str:
    """The --device and --load-format options of the run, where they are not the defaults."""
    return "".join(f" --{name.replace('_', '-')} {getattr(args, name)}" for name, default in
                   (("device", "cpu"), ("load_format", "auto")) if getattr(args, name) != default)


def _positive_integers(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(value) for value in text.split(",") if value.strip())
    except ValueError:
        raise ConfigError(f"{option} wants comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{option} wants positive integers, got {text!r}")
    return values
