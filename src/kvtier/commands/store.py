"""`kvtier store`: list the document KV store's entries, remove one, or clear it."""

import argparse
import time

from kvtier.commands.store_options import add_store_options
from kvtier.docstore.document_store import DocumentStore
from kvtier.units import format_size

_COLUMNS = ("ID", "TOKENS", "SIZE", "MODEL", "LAST USE", "DOCUMENT")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("store", help="list, remove or clear stored prompt KV",
                                   description="The document KV store: prompts' prefill KV kept for reuse.")
    actions = parser.add_subparsers(dest="store_action", metavar="{list,remove,clear}")
    listing = actions.add_parser("list", help="entries, most recently used first (the default)")
    remove = actions.add_parser("remove", help="remove one entry")
    remove.add_argument("id", help="entry id, or a prefix of it unique in the store")
    clear = actions.add_parser("clear", help="remove every entry")
    for action in (listing, remove, clear):
        add_store_options(action, reuse=False)
    parser.set_defaults(run=run, store_action="list")


def run(args: argparse.Namespace) -> int:
    store = DocumentStore(getattr(args, "kv_store", None))  # `kvtier store` alone: the default store
    if args.store_action == "remove":
        entry = store.remove(args.id)
        print(f"removed {entry.id} ({format_size(entry.nbytes)})")
    elif args.store_action == "clear":
        print(f"removed {store.clear()} entries from {store.root}")
    else:
        _print_entries(store)
    return 0


def _print_entries(store: DocumentStore) -> None:
    entries = store.entries()
    rows = [(entry.id, str(entry.meta.tokens), format_size(entry.nbytes), entry.meta.identity["model_id"],
             time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used)), _one_line(entry.meta.head))
            for entry in entries]
    widths = [max(len(row[i]) for row in (_COLUMNS, *rows)) for i in range(len(_COLUMNS))]
    for row in (_COLUMNS, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    print(f"{len(entries)} entries, {format_size(sum(entry.nbytes for entry in entries))} in {store.root}")


def _one_line(text: str) -> str:
    return " ".join(text.split())
