"""`kvtier` command line: generate | demo | batch | serve | store | models | cost |
bench {sparse,serve,http,accuracy,latency,report,store,vllm-tier}.

Every user-caused error (KvtierError) is printed as one line on stderr with a
non-zero exit code and no traceback.
"""

import argparse
import importlib
import logging
import sys

from kvtier.errors import KvtierError

# Command name -> module with add_parser(subparsers) and run(args). Only the module of the command
# being run is imported (as pip does): most commands pull in torch and transformers, 30-60 s on a
# 2-core machine, which `kvtier models` and `kvtier cost` do not need. Help and unknown commands
# import all of them, so argparse can list every choice.
COMMANDS = {name: f"kvtier.commands.{name}" for name in ("generate", "demo", "batch", "serve", "models", "cost", "store")}
BENCH_COMMANDS = {name: f"kvtier.commands.bench_{name.replace('-', '_')}"
                  for name in ("sparse", "serve", "http", "accuracy", "latency", "report", "store", "vllm-tier")}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv` (all commands when `argv` is None or names no known command)."""
    words = [word for word in (sys.argv[1:] if argv is None else argv) if not word.startswith("-")] + [None, None]
    command, bench_command = words[0], words[1] if words[0] == "bench" else None
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache runtime for long-context LLM inference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details to stderr")
    subparsers = parser.add_subparsers(dest="command", required=True)
    if command != "bench":
        _add_commands(subparsers, COMMANDS, command)
    if command not in COMMANDS:
        bench = subparsers.add_parser("bench", help="benchmarks that write bench/results/*.json and *.md")
        _add_commands(bench.add_subparsers(dest="bench", required=True), BENCH_COMMANDS, bench_command)
    return parser


def _add_commands(subparsers: argparse._SubParsersAction, commands: dict[str, str], requested: str | None) -> None:
    """Add the requested command's parser, or every command's when none or an unknown one is requested."""
    for name in [requested] if requested in commands else list(commands):
        importlib.import_module(commands[name]).add_parser(subparsers)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="kvtier: %(levelname)s: %(message)s")
    try:
        return args.run(args)
    except KvtierError as error:
        print(f"kvtier: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
