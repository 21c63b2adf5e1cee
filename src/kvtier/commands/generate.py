"""`kvtier generate`: one prompt (or a document plus a question) through a chosen KV mode."""

import argparse
import json
import sys
from pathlib import Path

from kvtier.commands.kv_options import add_dtype_option, add_kv_options, add_model_option, kv_config_from
from kvtier.commands.store_options import add_store_options, store_from
from kvtier.errors import ConfigError
from kvtier.generation import GenerationResult, generate
from kvtier.models.loader import load_model
from kvtier.units import format_size


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text with a tiered KV cache")
    add_model_option(parser)
    add_dtype_option(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--file", type=Path, help="a text file used as the document")
    parser.add_argument("--question", help="question asked after the --file document")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="prompt tokens per prefill forward pass")
    parser.add_argument("--json", action="store_true", help="end stdout with one JSON line of results")
    add_kv_options(parser)
    add_store_options(parser)
    parser.set_defaults(run=run)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        if args.question:
            raise ConfigError("--question goes with --file, not --prompt")
        return args.prompt
    try:
        document = args.file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read input file {args.file}: {getattr(error, 'strerror', None) or error}") from None
    if not document.strip():
        raise ConfigError(f"input file {args.file} is empty")
    return f"{document}\n\n{args.question}" if args.question else document


def summary_line(result: GenerationResult) -> str:
    tiers = ", ".join(f"{tier} {format_size(n)}" for tier, n in result.kv_bytes.items())
    return (
        f"[{result.kv_mode}] prefill {result.prefill_tokens} tok in {result.prefill_s:.1f}s | "
        f"decode {result.decode_tokens} tok, {result.ms_per_token:.1f} ms/tok | "
        f"disk read {format_size(result.disk_bytes_read)}, written {format_size(result.disk_bytes_written)} | KV {tiers}"
        f" | first token {result.ttft_s:.2f}s" + (f", {result.reused_prompt_tokens} prompt tok from the KV store"
                                                  if result.reused_prompt_tokens else "")
    )


def stream_to_stdout(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    prompt = read_prompt(args)
    kv_config = kv_config_from(args)
    store = store_from(args)
    llm = load_model(args.model, dtype=args.dtype)
    result = generate(llm, prompt, args.max_new_tokens, kv_config, args.prefill_chunk, on_text=stream_to_stdout,
                      kv_store=store)
    print()
    print(summary_line(result), file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_json()))
    return 0
