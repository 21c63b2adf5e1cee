"""Options and checks shared by the evaluation benchmarks (`kvtier bench accuracy`, `bench latency`, `bench ruler`).

Budgets as shares of the prompt's KV, the corpus, where KV files and results go, and
`--force`; results directories are checked before any model is loaded.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvtier.data.corpus import CORPUS_NAMES
from kvtier.errors import ConfigError, StorageError
from kvtier.eval.accuracy.budgets import BudgetShares
from kvtier.kv_config import default_storage_dir
from kvtier.models.load_formats import LOAD_FORMATS
from kvtier.paths import cache_dir


def add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host-share", type=float, default=BudgetShares.host, help="host KV budget / prompt KV")
    parser.add_argument("--device-share", type=float, default=BudgetShares.device, help="device KV budget / prompt KV")
    parser.add_argument("--corpus", choices=("auto", *CORPUS_NAMES), default="auto", help="text for prompts")
    parser.add_argument("--storage-dir", default=None, help="directory for KV files (default: <user cache>/kvtier/kv)")
    parser.add_argument("--force", action="store_true", help="rerun finished cells")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results directory")


def corpus_list(value: str) -> list[str]:
    """A `--corpora` value: comma-separated corpus names, each known and named once (argparse names a bad one)."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names or len(set(names)) != len(names) or any(name not in CORPUS_NAMES for name in names):
        raise argparse.ArgumentTypeError(f"{value!r}: give distinct names among {', '.join(CORPUS_NAMES)}, "
                                         "separated by commas")
    return names


def shares_from(args: argparse.Namespace) -> BudgetShares:
    """`--host-share` and `--device-share`, checked."""
    if not 0 < args.host_share <= 1 or not 0 <= args.device_share <= 1:
        raise ConfigError(f"--host-share must be in (0, 1] and --device-share in [0, 1], got {args.host_share} "
                          f"and {args.device_share}")
    return BudgetShares(args.host_share, args.device_share)


def names_from(text: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    """The comma-separated names of `text`, each one of `known` (a ConfigError naming `what` otherwise)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ConfigError(f"unknown {what} {', '.join(unknown) or repr(text)}; choose from {', '.join(known)}")
    return names


def add_device_options(parser: argparse.ArgumentParser, what_lives_there: str) -> None:
    """`--device` and `--load-format` (the throughput benchmarks that also run on a GPU)."""
    parser.add_argument("--device", default="cpu",
                        help=f"where {what_lives_there}: cpu, cuda or cuda:N (default %(default)s)")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                        help="auto: the model's weights; dummy: random weights in its architecture (throughput "
                             "only, outputs meaningless; for machines without the weights) (default %(default)s)")


def add_flash_dir_option(parser: argparse.ArgumentParser) -> None:
    """`--flash-dir` (the serving benchmarks' flash cache files)."""
    parser.add_argument("--flash-dir", type=Path, default=None,
                        help="directory for the flash cache files (default: <user cache>/kvtier/kv)")


def flash_dir_from(args: argparse.Namespace) -> Path:
    """`--flash-dir` (or its default), created if missing; a one-line error when it cannot be a directory."""
    flash_dir = args.flash_dir or cache_dir() / "kv"
    try:
        flash_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise StorageError(f"flash directory {flash_dir}: {error.strerror}; pass another --flash-dir") from error
    return flash_dir


def check_writable(out: Path) -> None:
    """Fail before any model load when no results can be written to `out`."""
    probe = out / f".kvtier-write-probe-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise StorageError(f"results directory {out} is not writable ({error.strerror}); pass another --out") from None


def storage_directory(option: str | None) -> Path:
    """`--storage-dir`, or the default KV directory, created."""
    directory = Path(option) if option else default_storage_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise StorageError(f"cannot create KV directory {directory} ({error.strerror}); "
                           "pass another --storage-dir") from None
    return directory
