"""`kvtier bench store`: time to first token of a document's first question vs a second one in a fresh process.

Each repeat empties a store, asks question one (a cold prefill that publishes the
document) and then question two, each as its own `kvtier generate` process, so
nothing but the store carries over. The store's records are read with O_DIRECT
(the result says whether the filesystem allowed it). Writes
bench/results/store-<model>-<context>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvtier.commands.bench_options import check_writable
from kvtier.commands.kv_options import add_dtype_option, add_model_option
from kvtier.data.corpus import CORPUS_NAMES, load_corpus
from kvtier.errors import ConfigError, KvtierError
from kvtier.eval.record import machine_info, spread
from kvtier.models.loader import load_model
from kvtier.storage import open_direct
from kvtier.store import DocumentStore
from kvtier.units import format_size

QUESTIONS = ("What is the text above about? Answer in one sentence.", "Name one person or place the text mentions.")
MODES = ("dense", "offload", "sparse")
BUDGETS = {"offload": ("--device-kv-budget", "8MiB", "--host-kv-budget", "48MiB"),
           "sparse": ("--device-kv-budget", "8MiB", "--host-kv-budget", "48MiB")}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("store", help="TTFT of a stored document's second question vs its first")
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
    llm = load_model(args.model, dtype=args.dtype)  # its tokenizer cuts the document; each question loads its own
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-store-") as scratch:
        document = Path(scratch) / "document.txt"
        document.write_text(_document(llm.tokenizer, args.context, args.corpus))
        store_dir = args.kv_store or Path(scratch) / "store"
        result = {"model": llm.name, "dtype": args.dtype, "context": args.context, "new_tokens": args.new_tokens,
                  "questions": QUESTIONS, "o_direct": _direct(store_dir), "machine": machine_info(store_dir),
                  "modes": {mode: _pairs(args, document, store_dir, mode) for mode in modes}}
    _write(result, args.out)
    return 0


def _document(tokenizer, tokens: int, corpus: str) -> str:
    """About `tokens` tokens of the corpus, cut at a token boundary."""
    text = load_corpus(corpus, min_chars=tokens * 6, progress=False).text
    ids = tokenizer(text)["input_ids"][:tokens]
    return tokenizer.decode(ids)


def _pairs(args: argparse.Namespace, document: Path, store_dir: Path, mode: str) -> dict:
    runs = []
    for repeat in range(args.repeats):
        DocumentStore(store_dir).clear()
        first, second = (_ask(args, document, store_dir, mode, question) for question in QUESTIONS)
        print(f"[bench store] {mode} repeat {repeat + 1}: first question {first['ttft_s']:.2f} s, "
              f"second {second['ttft_s']:.2f} s ({second['reused_prompt_tokens']} tokens reused)",
              file=sys.stderr, flush=True)
        runs.append({"first": first, "second": second, "ratio": second["ttft_s"] / first["ttft_s"]})
    return {"runs": runs, "first_ttft_s": spread([run["first"]["ttft_s"] for run in runs]),
            "second_ttft_s": spread([run["second"]["ttft_s"] for run in runs]),
            "ratio": spread([run["ratio"] for run in runs])}


def _ask(args: argparse.Namespace, document: Path, store_dir: Path, mode: str, question: str) -> dict:
    """One `kvtier generate` process; the fields of its --json line that this benchmark reports."""
    command = [sys.executable, "-m", "kvtier.cli", "generate", "--model", args.model, "--dtype", args.dtype,
               "--file", str(document), "--question", question, "--max-new-tokens", str(args.new_tokens), "--json",
               "--kv", mode, "--kv-store", str(store_dir), *BUDGETS.get(mode, ())]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise KvtierError(f"bench store: kvtier generate failed: {(done.stderr.strip() or 'no output').splitlines()[-1]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: answer[name] for name in ("ttft_s", "prefill_tokens", "reused_prompt_tokens", "kv_store_bytes_read",
                                            "prefill_s", "ms_per_token", "text")}


def _direct(store_dir: Path) -> bool:
    store_dir.mkdir(parents=True, exist_ok=True)
    probe = store_dir / f".probe-{os.getpid()}"
    fd, direct = open_direct(probe, os.O_WRONLY | os.O_CREAT)
    os.close(fd)
    probe.unlink()
    return direct


def _write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"store-{result['model']}-{result['context']}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out / stem}.json and {out / stem}.md")


def markdown(result: dict) -> str:
    lines = [f"# document KV store: {result['model']}, {result['context']}-token document", "",
             f"Each repeat: an emptied store, question one (cold prefill, publishes the document), then question two, "
             f"each a fresh `kvtier generate` process; store reads {'O_DIRECT' if result['o_direct'] else 'buffered'}. "
             f"Medians (min-max) over {len(next(iter(result['modes'].values()))['runs'])} repeats.", "",
             "| mode | first question TTFT | second question TTFT | second / first | reused tokens | read from store |",
             "|---|---|---|---|---|---|"]
    for mode, pairs in result["modes"].items():
        second = pairs["runs"][0]["second"]
        lines.append(f"| {mode} | {_seconds(pairs['first_ttft_s'])} | {_seconds(pairs['second_ttft_s'])} | "
                     f"{pairs['ratio']['median']:.3f} ({pairs['ratio']['min']:.3f}-{pairs['ratio']['max']:.3f}) | "
                     f"{second['reused_prompt_tokens']} of {second['prefill_tokens']} | "
                     f"{format_size(second['kv_store_bytes_read'])} |")
    lines += ["", "Every mode loads the whole stored prefix back into its cache (sparse then places it in its tiers "
              "again); using the cold pool's records in place is not done yet."]
    return "\n".join(lines) + "\n"


def _seconds(values: dict) -> str:
    return f"{values['median']:.2f} s ({values['min']:.2f}-{values['max']:.2f})"
