"""`kvtier bench report`: regenerate <results>/REPORT.md and its PNG plots from the result files there.

Sections: the latency experiments a-f (latency-*.json from `kvtier bench latency`), accuracy
(accuracy-*.json from `kvtier bench accuracy`), then the sparse-vs-offload runs
(sparse-*.json, `kvtier bench sparse`) and the serve benchmark (serve.json, `kvtier bench
serve`), rendered as those benchmarks render them. A missing experiment says "not run yet". Needs
matplotlib: `pip install 'kvtier[bench]'`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtier.commands.bench_options import check_writable


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("bench/results"), help="results directory")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    check_writable(args.results)
    # only now: the report's modules import torch (seconds), the options are checked first
    from kvtier.eval.report.markdown_report import appendices, write_report

    report, plots = write_report(args.results, appendices(args.results))
    print(f"wrote {report} and {len(plots)} plots in {args.results / 'plots'}")
    return 0
