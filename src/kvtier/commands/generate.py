"""`kvtier generate`: one prompt (or a document plus a question) through a chosen KV mode."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.commands.console import end_answer, write_answer
from kvtier.commands.kv_options import add_dtype_option, add_kv_options, add_model_option, kv_config_from
from kvtier.commands.store_options import add_store_options, store_from
from kvtier.docstore.document_store import DocumentStore
from kvtier.errors import ConfigError
from kvtier.kv_config import KVConfig
from kvtier.units import format_size

if TYPE_CHECKING:
    from kvtier.generation import GenerationResult


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate")
    add_model_option(parser)
    add_dtype_option(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--file", type=Path, help="a text file used as the document")
    parser.add_argument("--encoding", default="utf-8", help="text encoding of the --file (default %(default)s)")
    parser.add_argument("--question", help="question asked after the --file document")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="prompt tokens per prefill forward pass")
    parser.add_argument("--json", action="store_true",
                        help="end stdout with one JSON line of results (with each decode step's ms, `step_ms`)")
    add_kv_options(parser)
    add_store_options(parser)
    parser.set_defaults(run=run)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        if args.question:
            raise ConfigError("--question goes with --file, not --prompt")
        return args.prompt
    try:
        document = args.file.read_text(encoding=args.encoding)
    except OSError as error:
        raise ConfigError(f"cannot read input file {args.file}: {error.strerror}") from None
    except LookupError:
        raise ConfigError(f"--encoding {args.encoding}: unknown text encoding; e.g. utf-8, latin-1, cp1252") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"input file {args.file} is not {args.encoding} text (byte 0x{error.object[error.start]:02x} "
                          f"at offset {error.start}); give its encoding, e.g. --encoding latin-1") from None
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


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    prompt = read_prompt(args)
    clock = TokenClock()
    result = _answer(args, prompt, kv_config_from(args), store_from(args), clock)
    print(summary_line(result), file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_json() | {"step_ms": clock.step_ms(result.decode_tokens)}))
    return 0


class TokenClock:
    """A generation's `watch` that cancels nothing and notes when it is called: after every prefill chunk and as each
    new token is chosen, so the last calls time the decode's forward passes one by one."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, cache: object) -> bool:
        self.times.append(time.perf_counter())
        return False

    def step_ms(self, tokens: int) -> list[float]:
        """The ms between the choices of the last `tokens` tokens: each decode forward pass after the first token."""
        chosen = self.times[-tokens:] if tokens else []
        return [(later - earlier) * 1000 for earlier, later in zip(chosen, chosen[1:])]


def _answer(args: argparse.Namespace, prompt: str, kv_config: KVConfig, store: DocumentStore | None,
            watch: TokenClock) -> GenerationResult:
    """Load the model and stream its answer to stdout (torch and transformers, seconds to import, only now)."""
    from kvtier.generation import generate
    from kvtier.models.loader import load_model

    llm = load_model(args.model, dtype=args.dtype)
    try:
        return generate(llm, prompt, args.max_new_tokens, kv_config, args.prefill_chunk, on_text=write_answer,
                        progress=args.progress, kv_store=store, watch=watch)
    finally:
        end_answer()
