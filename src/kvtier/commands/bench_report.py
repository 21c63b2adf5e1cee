"""`kvtier bench report`: regenerate <results>/REPORT.md and its PNG plots from the result files there.

Sections: the latency experiments a-f (latency-*.json from `kvtier bench latency`), accuracy
(accuracy-*.json from `kvtier bench accuracy`), then the sparse-vs-offload runs
(sparse-*.json, `kvtier bench sparse`) and the serve benchmark (serve.json, `kvtier bench
serve`) as those commands render them. A missing experiment says "not run yet". Needs
matplotlib: `pip install 'kvtier[bench]'`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtier.commands import bench_serve, bench_sparse
from kvtier.commands.bench_options import check_writable
from kvtier.eval.report import read_json, write_report


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("report", help="regenerate bench/results/REPORT.md and plots from the JSON files",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("bench/results"), help="results directory")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    check_writable(args.results)
    report, plots = write_report(args.results, appendices(args.results))
    print(f"wrote {report} and {len(plots)} plots in {args.results / 'plots'}")
    return 0


def appendices(directory: Path) -> list[tuple[str, str]]:
    """(title, markdown) of the sparse-*.json and serve.json files, rendered by the commands that wrote them."""
    sections = [(f"Sparse vs offload (`{path.name}`)", bench_sparse.markdown(read_json(path)))
                for path in sorted(directory.glob("sparse-*.json"))]
    serve = directory / "serve.json"
    if serve.is_file():
        sections.append(("Serve benchmark (`serve.json`)", bench_serve.render_markdown(read_json(serve))))
    return sections
