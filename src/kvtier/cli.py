"""`kvtier` command line: generate | demo | batch | bench {sparse,serve,accuracy,latency,report} | models | cost.

Every user-caused error (KvtierError) is printed as one line on stderr with a
non-zero exit code and no traceback.
"""

import argparse
import logging
import sys

from kvtier.errors import KvtierError


def build_parser() -> argparse.ArgumentParser:
    from kvtier.commands import (batch, bench_accuracy, bench_latency, bench_report, bench_serve, bench_sparse, cost,
                                 demo, generate, models)

    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache runtime for long-context LLM inference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details to stderr")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in (generate, demo, batch, models, cost):
        command.add_parser(subparsers)
    bench = subparsers.add_parser("bench", help="benchmarks that write bench/results/*.json and *.md")
    bench_commands = bench.add_subparsers(dest="bench", required=True)
    for command in (bench_sparse, bench_serve, bench_accuracy, bench_latency, bench_report):
        command.add_parser(bench_commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
