"""`kvtier batch`: offline generation of a JSONL file of prompts through the serving engine.

Input: one JSON object per line, {"prompt": "..."} with optional "max_new_tokens",
"ignore_eos" (true: always generate max_new_tokens) and "priority" (higher is preempted later). A prompt beyond the device pool runs as a tiered sequence
(HillInfer's tiers), as `kvtier serve` runs it. Output: one JSON object per input line, in input
order, with the generated text and token ids, plus a summary on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.commands.kv_options import add_dtype_option, add_model_option
from kvtier.commands.serve_options import add_engine_options, engine_config_from, tiers_from
from kvtier.errors import ConfigError
from kvtier.engine.sequence import SamplingParams


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("batch", description=__doc__.split("\n\n")[1])
    add_model_option(parser)
    add_dtype_option(parser)
    parser.add_argument("--file", type=Path, required=True, help="prompts, one JSON object per line")
    parser.add_argument("--output", type=Path, help="results JSONL (default: stdout)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="default per request (default %(default)s)")
    add_engine_options(parser)
    parser.set_defaults(run=run)
    return parser


def read_requests(path: Path, default_max_new_tokens: int) -> list[tuple[str, SamplingParams]]:
    """(prompt, sampling) for each non-empty line of a JSONL file; ConfigError naming the bad line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {getattr(error, 'strerror', None) or error}") from None
    requests = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            requests.append(_parse_request(line, f"{path}:{number}", default_max_new_tokens))
    if not requests:
        raise ConfigError(f"{path} holds no prompts; write one JSON object per line, e.g. {{\"prompt\": \"Hi\"}}")
    return requests


def _parse_request(line: str, where: str, default_max_new_tokens: int) -> tuple[str, SamplingParams]:
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where}: not JSON ({error.msg}); write one object per line") from None
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise ConfigError(f'{where}: expected an object with a "prompt" string')
    if not isinstance(record.get("ignore_eos", False), bool):
        raise ConfigError(f"{where}: ignore_eos must be true or false")
    try:
        sampling = SamplingParams(max_new_tokens=record.get("max_new_tokens", default_max_new_tokens),
                                  ignore_eos=record.get("ignore_eos", False), priority=int(record.get("priority", 0)))
    except (ConfigError, TypeError, ValueError) as error:
        raise ConfigError(f"{where}: {error}") from None
    return record["prompt"], sampling


def run(args: argparse.Namespace) -> int:
    requests = read_requests(args.file, args.max_new_tokens)
    config = engine_config_from(args)
    from kvtier.engine.serving_engine import LLMEngine  # only now: torch takes seconds, the options are checked first
    from kvtier.models.loader import load_model

    llm = load_model(args.model, dtype=args.dtype)
    started = time.perf_counter()
    with LLMEngine.from_llm(llm, config, tiers_from(args, llm)) as engine:
        ids = [engine.add_request(prompt, sampling) for prompt, sampling in requests]
        done = {}
        while engine.has_unfinished():
            done.update((output.request_id, output) for output in engine.step())
        stats = engine.stats()
    elapsed = time.perf_counter() - started
    lines = [json.dumps(done[request_id].to_json()) for request_id in ids]
    if args.output:
        args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    else:
        print("\n".join(lines))
    generated = sum(len(done[request_id].token_ids) for request_id in ids)
    scheduler = stats["scheduler"]
    print(f"[batch] {len(ids)} requests, {generated} tokens in {elapsed:.1f}s ({generated / elapsed:.1f} tok/s) | "
          f"swap {config.swap}: {scheduler['swap_outs']} out, {scheduler['swap_ins']} in, "
          f"{scheduler['recomputes']} recomputed", file=sys.stderr)
    return 0
