"""`kvtier bench store`'s experiment: time to first token of a document's first question vs a second one, each
asked by a fresh `kvtier generate` process, so nothing but the document KV store carries over."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvtier.data.corpus import load_corpus
from kvtier.errors import KvtierError
from kvtier.eval.record import accepts_direct_io, machine_info, spread
from kvtier.docstore import DocumentStore
from kvtier.units import format_size

QUESTIONS = ("What is the text above about? Answer in one sentence.", "Name one person or place the text mentions.")
MODES = ("dense", "offload", "sparse")
BUDGETS = {"offload": ("--device-kv-budget", "8MiB", "--host-kv-budget", "48MiB"),
           "sparse": ("--device-kv-budget", "8MiB", "--host-kv-budget", "48MiB")}


@dataclass(frozen=True)
class StoreBench:
    """One run's settings (the command's options of the same names)."""

    model: str
    dtype: str
    context: int  # document tokens
    new_tokens: int
    repeats: int  # first/second question pairs per mode
    corpus: str


def run_store_benchmark(llm, bench: StoreBench, modes: list[str], store_dir: Path | None) -> dict:
    """`bench.repeats` question pairs per mode on one document of `llm`'s tokens; the result record. `store_dir` is
    emptied before each pair (default: a temporary one)."""
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-store-") as scratch:
        document = Path(scratch) / "document.txt"
        document.write_text(_document(llm.tokenizer, bench.context, bench.corpus))
        store_dir = store_dir or Path(scratch) / "store"
        store_dir.mkdir(parents=True, exist_ok=True)
        return {"model": llm.name, "dtype": bench.dtype, "context": bench.context, "new_tokens": bench.new_tokens,
                "questions": QUESTIONS, "o_direct": accepts_direct_io(store_dir), "machine": machine_info(store_dir),
                "modes": {mode: _pairs(bench, document, store_dir, mode) for mode in modes}}


def _document(tokenizer, tokens: int, corpus: str) -> str:
    """About `tokens` tokens of the corpus, cut at a token boundary."""
    text = load_corpus(corpus, min_chars=tokens * 6, progress=False).text
    ids = tokenizer(text)["input_ids"][:tokens]
    return tokenizer.decode(ids)


def _pairs(bench: StoreBench, document: Path, store_dir: Path, mode: str) -> dict:
    runs = []
    for repeat in range(bench.repeats):
        DocumentStore(store_dir).clear()
        first, second = (_ask(bench, document, store_dir, mode, question) for question in QUESTIONS)
        print(f"[bench store] {mode} repeat {repeat + 1}: first question {first['ttft_s']:.2f} s, "
              f"second {second['ttft_s']:.2f} s ({second['reused_prompt_tokens']} tokens reused)",
              file=sys.stderr, flush=True)
        runs.append({"first": first, "second": second, "ratio": second["ttft_s"] / first["ttft_s"]})
    return {"runs": runs, "first_ttft_s": spread([run["first"]["ttft_s"] for run in runs]),
            "second_ttft_s": spread([run["second"]["ttft_s"] for run in runs]),
            "ratio": spread([run["ratio"] for run in runs])}


def _ask(bench: StoreBench, document: Path, store_dir: Path, mode: str, question: str) -> dict:
    """One `kvtier generate` process; the fields of its --json line that this benchmark reports."""
    command = [sys.executable, "-m", "kvtier.cli", "generate", "--model", bench.model, "--dtype", bench.dtype,
               "--file", str(document), "--question", question, "--max-new-tokens", str(bench.new_tokens), "--json",
               "--kv", mode, "--kv-store", str(store_dir), *BUDGETS.get(mode, ())]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise KvtierError(f"bench store: kvtier generate failed: {(done.stderr.strip() or 'no output').splitlines()[-1]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: answer[name] for name in ("ttft_s", "prefill_tokens", "reused_prompt_tokens", "kv_store_bytes_read",
                                            "disk_bytes_written", "prefill_s", "ms_per_token", "text")}


def write_results(result: dict, out: Path) -> None:
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
             "| mode | first question TTFT | second question TTFT | second / first | reused tokens | read from store | "
             "second question's KV writes |",
             "|---|---|---|---|---|---|---|"]
    for mode, pairs in result["modes"].items():
        second = pairs["runs"][0]["second"]
        lines.append(f"| {mode} | {_seconds(pairs['first_ttft_s'])} | {_seconds(pairs['second_ttft_s'])} | "
                     f"{pairs['ratio']['median']:.3f} ({pairs['ratio']['min']:.3f}-{pairs['ratio']['max']:.3f}) | "
                     f"{second['reused_prompt_tokens']} of {second['prefill_tokens']} | "
                     f"{format_size(second['kv_store_bytes_read'])} | "
                     f"{format_size(second.get('disk_bytes_written', 0))} |")
    lines += ["", "Every mode reads the stored prefix's K/V back once, for the question's exact prefill over it; "
              "offload then reads the prefix's spilled part from the stored K/V where it lies instead of writing "
              "it to its own file, and sparse uses the cold pool stored with the document in place (its records "
              "and sketches read where they lie, the hot pool and hit table restored) instead of placing the "
              "prefix in its tiers again. Read from store: the K/V and, for sparse, the image's tables and page "
              "checksums; the stored K/V and cold pool read in place during decode are counted with the steps' "
              "disk reads."]
    return "\n".join(lines) + "\n"


def _seconds(values: dict) -> str:
    return f"{values['median']:.2f} s ({values['min']:.2f}-{values['max']:.2f})"
