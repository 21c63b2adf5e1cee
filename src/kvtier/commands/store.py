"""`kvtier store`: list the document KV store's entries, remove one, or clear it.

A store path that does not exist yet lists as empty and is not created.
"""

import argparse
import time
from pathlib import Path

from kvtier.commands.store_options import add_store_options, store_root
from kvtier.docstore.document_store import DocumentStore, StoredEntry
from kvtier.errors import ConfigError
from kvtier.units import counted, format_size

_COLUMNS = ("ID", "TOKENS", "SIZE", "MODEL", "LAST USE", "DOCUMENT")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("store", description="The document KV store: prompts' prefill KV kept for reuse.")
    actions = parser.add_subparsers(dest="store_action", metavar="{list,remove,clear}")
    listing = actions.add_parser("list", help="entries, most recently used first (the default)")
    remove = actions.add_parser("remove", help="remove one entry")
    remove.add_argument("id", help="entry id, or a prefix of it unique in the store")
    clear = actions.add_parser("clear", help="remove every entry")
    for action in (listing, remove, clear):
        add_store_options(action, reuse=False)
    parser.set_defaults(run=run, store_action="list")


def run(args: argparse.Namespace) -> int:
    root = store_root(getattr(args, "kv_store", None))  # `kvtier store` alone: the default store
    store = DocumentStore(root) if root.exists() else None
    if args.store_action == "remove":
        if store is None:
            raise ConfigError(f"there is no KV store at {root}; nothing to remove")
        entry_id, freed = store.remove(args.id)
        print(f"removed {entry_id} ({format_size(freed)})")
    elif args.store_action == "clear":
        removed, freed = store.clear() if store is not None else (0, 0)
        print(f"removed {counted(removed, 'entry', 'entries')} ({format_size(freed)}) from {root}")
    else:
        _print_entries(store.entries() if store is not None else [], root)
    return 0


def _print_entries(entries: list[StoredEntry], root: Path) -> None:
    sizes = [entry.nbytes for entry in entries]  # measured once: each is a walk of the entry's files
    rows = [(entry.id, str(entry.meta.tokens), format_size(size), entry.meta.identity["model_id"],
             time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used)), _one_line(entry.meta.head))
            for entry, size in zip(entries, sizes)]
    widths = [max(len(row[i]) for row in (_COLUMNS, *rows)) for i in range(len(_COLUMNS))]
    for row in (_COLUMNS, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    print(f"{counted(len(entries), 'entry', 'entries')}, {format_size(sum(sizes))} in {root}")


def _one_line(text: str) -> str:
    return " ".join(text.split())
