"""`kvtier bench generate`'s experiment: the `kvtier generate` a user runs, timed per corpus and KV mode.

Each run is the real command line (`python -m kvtier.cli generate --file <document> --question ... --json`) in a
fresh process, so everything a user's answer costs is in it: the stored document read back, the sparse tiers placed,
the scorer process started, the first decode steps. Per corpus, a document of `context` tokens is cut from the corpus
and written to a file; untimed one-token runs store it in the document KV store, one per tiered mode (the first
stores its K/V, a sparse run adds its placed tiers), so every timed run of every mode reads the same stored document. Modes then run
in alternating rounds (dense, offload, sparse, dense, ...), the page cache dropped before each run where the process
may (root on Linux; the result records whether it was): the KV files are read with O_DIRECT either way, the drop
makes the stored document and the weights come from the disk too. Each run reports ms/token over the decode (every
forward pass after the first token), the first `first_steps` passes and the later ones apart (a short answer is
mostly its first steps), the disk bytes read, the time to the first token and the answer, compared with dense's of
the same round.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.data.corpus import load_corpus
from kvtier.errors import KvtierError

# A `kvtier generate` argument list -> the run's JSON line, with `process_s`: the process's wall time.
Runner = Callable[[list[str]], dict]
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
# Modes beside the KV modes: a KV mode with options of its own (the sparse path's adaptive budget)
VARIANTS = {"sparse-auto": ("sparse", ("--alpha", "auto"))}


class GenerateRunError(KvtierError):
    """A `kvtier generate` run of the benchmark failed: its command and the last line it wrote to stderr."""


@dataclass(frozen=True)
class GenerateBench:
    """What one run compares (the command's options of the same names)."""

    model: str
    dtype: str
    context: int  # document tokens
    corpora: tuple[str, ...]
    modes: tuple[str, ...]  # KV modes, in the order each round runs them
    max_new_tokens: int
    device_kv_budget: str
    host_kv_budget: str
    rounds: int
    first_steps: int  # decode passes reported apart, at the start of the answer
    question: str
    storage_dir: str
    kv_store: str | None  # the document KV store every run uses (None: the user's default)


def subprocess_runner(argv: list[str]) -> dict:
    """`kvtier <argv>` in a fresh Python process; its last stdout line parsed as JSON, with `process_s`."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", *argv], capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise GenerateRunError(f"`kvtier {' '.join(argv[:3])} ...` exited with {done.returncode}: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"process_s": elapsed}


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the page cache; False where this process may not (not root, not Linux)."""
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
    except OSError:
        return False
    return True


def write_documents(tokenizer, corpora: tuple[str, ...], tokens: int, directory: Path) -> dict[str, Path]:
    """Per corpus, its first `tokens` tokens (by `tokenizer`) as a text file in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    documents = {}
    for name in corpora:
        text = load_corpus(name, min_chars=tokens * 8, progress=False).text
        ids = tokenizer(text)["input_ids"][:tokens]
        documents[name] = directory / f"{name}-{tokens}.txt"
        documents[name].write_text(tokenizer.decode(ids), encoding="utf-8")
    return documents


def run_generate_benchmark(bench: GenerateBench, documents: dict[str, Path], runner: Runner = subprocess_runner,
                           drop: Callable[[], bool] = drop_page_cache,
                           on_run: Callable[[str], object] = lambda line: None) -> dict:
    """Every corpus's document through every mode in alternating rounds; the result record. `on_run` gets a line
    per timed run as it ends (corpus, mode, round, ms/token)."""
    result = {"model": bench.model, "dtype": bench.dtype, "context": bench.context, "modes": list(bench.modes),
              "max_new_tokens": bench.max_new_tokens, "device_kv_budget": bench.device_kv_budget,
              "host_kv_budget": bench.host_kv_budget, "rounds": bench.rounds, "first_steps": bench.first_steps,
              "question": bench.question, "corpora": {}}
    for corpus, document in documents.items():
        stored = [runner(_argv(bench, document, mode, max_new_tokens=1)) for mode in _storing_modes(bench.modes)]
        runs: dict[str, list[dict]] = {mode: [] for mode in bench.modes}
        for round_number in range(1, bench.rounds + 1):
            for mode in bench.modes:
                dropped = drop()
                runs[mode].append(_run_summary(runner(_argv(bench, document, mode)), bench.first_steps, dropped))
                on_run(f"{corpus} {mode} round {round_number}: {runs[mode][-1]['ms_per_token']:.1f} ms/token")
        result["corpora"][corpus] = {"document_tokens": bench.context, "store_run_prefill_s": stored[0]["prefill_s"],
                                     "runs": runs}
    return result


def _storing_modes(modes: tuple[str, ...]) -> list[str]:
    """The modes whose untimed runs store the document: every tiered one (each adds what it places), else dense."""
    return [mode for mode in modes if mode != "dense"] or [modes[0]]


def _argv(bench: GenerateBench, document: Path, mode: str, max_new_tokens: int | None = None) -> list[str]:
    """The `kvtier generate` arguments of one run (budgets for the tiered modes only: dense keeps every token); a
    VARIANTS mode runs its KV mode with its options."""
    kv, options = VARIANTS.get(mode, (mode, ()))
    argv = ["generate", "--model", bench.model, "--dtype", bench.dtype, "--file", str(document),
            "--question", bench.question, "--max-new-tokens", str(max_new_tokens or bench.max_new_tokens),
            "--kv", kv, *options, "--storage-dir", bench.storage_dir, "--json"]
    if mode != "dense":
        argv += ["--device-kv-budget", bench.device_kv_budget, "--host-kv-budget", bench.host_kv_budget]
    return argv + (["--kv-store", bench.kv_store] if bench.kv_store else [])


def _run_summary(run: dict, first_steps: int, dropped: bool) -> dict:
    """One run's numbers: ms/token over the decode and over its first and later passes, bytes, answer."""
    steps = run["step_ms"]
    first, later = steps[:first_steps], steps[first_steps:]
    return {"ms_per_token": run["ms_per_token"], "first_steps_ms": statistics.mean(first) if first else None,
            "later_steps_ms": statistics.median(later) if later else None, "step_ms": steps,
            "decode_tokens": run["decode_tokens"], "disk_bytes_read": run["disk_bytes_read"],
            "ttft_s": run["ttft_s"], "prefill_s": run["prefill_s"], "prefill_tokens": run["prefill_tokens"],
            "reused_prompt_tokens": run["reused_prompt_tokens"], "process_s": run["process_s"],
            "page_cache_dropped": dropped, "text": run["text"]}
