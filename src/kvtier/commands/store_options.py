"""Command-line options of the document KV store (no torch import: `kvtier store list` answers at once)."""

import argparse
from pathlib import Path

from kvtier.docstore import document_store
from kvtier.docstore.document_store import DEFAULT_SIZE, ON_CORRUPT, DocumentStore
from kvtier.errors import ConfigError


def add_store_options(parser: argparse.ArgumentParser, reuse: bool = True) -> None:
    """--kv-store (and, for commands that reuse prompts, the switches of reuse)."""
    group = parser.add_argument_group("document KV store")
    group.add_argument("--kv-store", default=None, metavar="DIR",
                       help="where prompts' prefill KV is kept for reuse (default: <user cache>/kvtier/store)")
    if not reuse:
        return
    group.add_argument("--no-kv-store", action="store_true", help="neither reuse nor store prompt KV")
    group.add_argument("--kv-store-size", default=DEFAULT_SIZE,
                       help="bound of the store; least recently used entries go first (default %(default)s)")
    group.add_argument("--on-corrupt", choices=ON_CORRUPT, default="recompute",
                       help="a damaged stored entry: drop it and prefill again, or fail (default %(default)s)")


def store_root(option: str | None) -> Path:
    """The directory `--kv-store` names (None: the user's default store); ConfigError when it is a file."""
    root = Path(option) if option else document_store.default_store_dir()
    if root.is_file():
        raise ConfigError(f"--kv-store {root} is a file; the KV store is a directory (give one, or leave the option "
                          "out for the default)")
    return root


def store_from(args: argparse.Namespace) -> DocumentStore | None:
    """The store the options name; None with --no-kv-store."""
    if getattr(args, "no_kv_store", False):
        return None
    return DocumentStore(store_root(args.kv_store), getattr(args, "kv_store_size", DEFAULT_SIZE),
                         getattr(args, "on_corrupt", "recompute"))
