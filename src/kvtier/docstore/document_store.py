"""DocumentStore: entries of prefill KV in one directory, found by their longest common prefix with a prompt.

Layout: `<root>/<entry id>/{meta.json, kv.bin}` (entry.py). An entry is built in
`<root>/.tmp-<pid>-<hex>` and renamed to its id (the key of its last block) when
complete; a writer killed before that leaves only a temporary directory, which
the next store opened on the root removes once that pid is gone. Removal renames
an entry to `.trash-...` first, so no reader sees half an entry. Two processes
storing one document at once (different questions) do not both publish: the
later finds the earlier's entry and drops its copy; on the very same prompt
they race on the rename, and one wins.

Least-recently-used entries are evicted to keep the total under `size_limit`;
the last use is the mtime of meta.json, touched on every reuse.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError, StorageError, setting
from kvtier.paths import cache_dir
from kvtier.processes import process_exists
from kvtier.storage import fsync_directory
from kvtier.docstore.meta import META, CorruptEntry, EntryMeta, read_meta
from kvtier.units import format_size, parse_size

if TYPE_CHECKING:
    from kvtier.docstore.entry import EntryWriter

log = logging.getLogger(__name__)
DEFAULT_SIZE = "20GiB"
ON_CORRUPT = ("recompute", "fail")
_TEMPORARY, _TRASH, _PUBLISHING = ".tmp-", ".trash-", "publish.lock"


def default_store_dir() -> Path:
    return cache_dir() / "store"


@dataclass
class StoredEntry:
    id: str
    path: Path
    meta: EntryMeta
    last_used: float

    @property
    def nbytes(self) -> int:
        """Disk bytes of the entry: its K/V and what a KV mode stored with it (the sparse path's tier image)."""
        return disk_bytes(self.path)


@dataclass
class Match:
    """The longest stored prefix of a prompt: `blocks` whole blocks of `entry`."""

    entry: StoredEntry
    blocks: int

    @property
    def tokens(self) -> int:
        return self.blocks * self.entry.meta.block_tokens


class DocumentStore:
    """Prefill KV entries under `root`, at most `size_limit` bytes in all."""

    def __init__(self, root: str | os.PathLike[str] | None = None, size_limit: str | int = DEFAULT_SIZE,
                 on_corrupt: str = "recompute") -> None:
        if on_corrupt not in ON_CORRUPT:
            raise ConfigError(f"unknown {setting('on_corrupt')} {on_corrupt!r}; choose one of {', '.join(ON_CORRUPT)}")
        self.root = Path(root) if root is not None else default_store_dir()
        self.size_limit = parse_size(size_limit)
        self.on_corrupt = on_corrupt
        self._told_foreign: set[str] = set()  # entries longest_prefix warned of
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StorageError(f"cannot use KV store {self.root}: {error.strerror}") from None
        if not self.root.is_dir():
            raise StorageError(f"KV store {self.root} is not a directory")
        self._remove_abandoned()

    # ----- lookup -----

    def entries(self) -> list[StoredEntry]:
        """Complete, readable entries, most recently used first (damaged ones are reported and skipped)."""
        found = []
        for path in self._entry_dirs():
            try:
                found.append(StoredEntry(path.name, path, read_meta(path), (path / META).stat().st_mtime))
            except CorruptEntry as error:
                self.drop(path, str(error))
            except FileNotFoundError:
                continue  # removed meanwhile by another process
        return sorted(found, key=lambda entry: -entry.last_used)

    def longest_prefix(self, identity_digest: str, keys: list[str], document: str, limit: int) -> Match | None:
        """The entry sharing the most leading blocks with `keys` (at most `limit` of them), or None."""
        best, foreign = self._longest_prefix(identity_digest, keys, document, limit)
        for entry in foreign if best is None else []:  # said once per entry, and only when it explains a cold prompt
            if entry.id not in self._told_foreign:
                self._told_foreign.add(entry.id)
                log.warning("KV store entry %s holds this document for another model, dtype or layout (%s); "
                            "not used", entry.id, entry.meta.identity.get("model_id"))
        return best

    def _longest_prefix(self, identity_digest: str, keys: list[str], document: str, limit: int
                        ) -> tuple[Match | None, list[StoredEntry]]:
        """(longest_prefix's match, the entries of this document for another model, dtype or layout)."""
        best: Match | None = None
        foreign = []
        for entry in self.entries():
            if entry.meta.identity_digest != identity_digest:
                foreign += [entry] if entry.meta.document == document else []
                continue
            blocks = _common_blocks(entry.meta.blocks, keys, limit)
            if blocks and (best is None or blocks > best.blocks):
                best = Match(entry, blocks)
        return best, foreign

    def touch(self, entry: StoredEntry) -> None:
        try:
            os.utime(entry.path / META)
        except OSError:
            pass  # a read-only store still serves; its LRU order just does not move

    # ----- publishing -----

    def room_for(self, nbytes: int) -> Path | None:
        """A temporary directory name for a new entry of `nbytes`, after evicting what must go; None (with a
        warning) when the store cannot hold it."""
        if nbytes > self.size_limit:
            log.warning("the prompt's KV (%s) is larger than the KV store's limit (%s); not stored",
                        format_size(nbytes), format_size(self.size_limit))
            return None
        self._evict_until_free(nbytes)
        return self.root / f"{_TEMPORARY}{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def cannot_write(self, error: OSError, directory: Path) -> None:
        """A failed write (full disk, read-only store): say so, leave nothing behind."""
        shutil.rmtree(directory, ignore_errors=True)
        log.warning("cannot write to the KV store %s (%s); the prompt is not stored", self.root, error.strerror)

    def discard(self, writer: EntryWriter, error: OSError | None = None) -> None:
        """Drop an unpublished entry (with a warning when a write failed)."""
        writer.abandon()
        if error is not None:
            self.cannot_write(error, writer.directory)
        else:
            shutil.rmtree(writer.directory, ignore_errors=True)

    def publish(self, writer: EntryWriter) -> str | None:
        """Complete the entry and make it visible under its id; None if it could not be (the reason is logged).
        When another process stored most of its blocks meanwhile (two questions on one new document at once), that
        entry's id instead: the second copy is dropped, as a prompt planned now would not have written it."""
        try:
            writer.finish()
            with self._one_publisher():
                held = self._holding_most_of(writer.meta)
                if held is not None:
                    log.info("KV store: entry %s, stored meanwhile, holds this prompt's document; not stored twice",
                             held)
                    shutil.rmtree(writer.directory, ignore_errors=True)
                    return held
                self._evict_until_free(disk_bytes(writer.directory))  # room was made for its K/V; now for all of it
                entry_id = writer.meta.blocks[-1][:20]
                os.rename(writer.directory, self.root / entry_id)
            fsync_directory(self.root)
            return entry_id
        except OSError as error:
            self.discard(writer, error)
            return None

    def _holding_most_of(self, meta: EntryMeta) -> str | None:
        """The id of an entry holding at least half of `meta`'s blocks (all of them: the same prompt), if any."""
        held, _ = self._longest_prefix(meta.identity_digest, meta.blocks, meta.document, len(meta.blocks))
        return held.entry.id if held is not None and not worth_an_entry(len(meta.blocks), held.blocks) else None

    @contextmanager
    def _one_publisher(self) -> Iterator[None]:
        """Held by a publisher while it looks for a copy stored meanwhile and renames its own: of two processes
        storing one document, the later sees the earlier's entry."""
        try:
            fd = os.open(self.root / _PUBLISHING, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            yield  # a read-only store: the rename fails and says so
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for a lookup and a rename: milliseconds
            yield
        finally:
            os.close(fd)

    # ----- removal -----

    def drop(self, path: Path, reason: str) -> None:
        """Remove a damaged entry, saying why."""
        log.warning("KV store entry %s is damaged (%s); removed", path.name, reason)
        self._remove(path)

    def remove(self, id_prefix: str) -> tuple[str, int]:
        """Remove the one entry whose id starts with `id_prefix`; (its id, the disk bytes freed).

        Raises ConfigError when no entry or several match, StorageError naming the entry and the reason when it cannot
        be removed (a read-only store)."""
        matches = [entry for entry in self.entries() if entry.id.startswith(id_prefix)]
        if len(matches) != 1:
            raise ConfigError(f"{'no' if not matches else 'more than one'} KV store entry starts with {id_prefix!r}; "
                              "see `kvtier store list`")
        return matches[0].id, self._delete(matches[0].path)

    def clear(self) -> tuple[int, int]:
        """Remove every entry; (entries removed, disk bytes freed). StorageError at the first that cannot be removed,
        naming it and the reason (the entries before it are gone)."""
        entries = self.entries()
        return len(entries), sum(self._delete(entry.path) for entry in entries)

    def _evict_until_free(self, nbytes: int) -> None:
        entries = self.entries()
        sizes = {entry.id: entry.nbytes for entry in entries}
        total = sum(sizes.values())
        for entry in reversed(entries):  # least recently used first
            if total + nbytes <= self.size_limit:
                return
            log.info("KV store full: evicting %s (%s)", entry.id, format_size(sizes[entry.id]))
            self._remove(entry.path)
            total -= sizes[entry.id]

    def _remove(self, path: Path) -> None:
        """`_delete` for eviction and damaged entries: a store that cannot remove them (read-only) still serves."""
        try:
            self._delete(path)
        except StorageError as error:
            log.debug("%s", error)

    def _delete(self, path: Path) -> int:
        """Remove the entry at `path`; the disk bytes freed (0 when another process removed it first).

        Raises StorageError naming the entry and the reason when it cannot be removed, or not all of it."""
        nbytes = disk_bytes(path)
        trash = self.root / f"{_TRASH}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, trash)  # first, so no reader sees half an entry
        except FileNotFoundError:
            return 0
        except OSError as error:
            raise StorageError(f"cannot remove KV store entry {path.name} from {self.root}: {error.strerror}") from None
        shutil.rmtree(trash, ignore_errors=True)
        if trash.exists():
            raise StorageError(f"KV store entry {path.name} is only partly removed: {trash.name} is left in "
                               f"{self.root}; check its permissions")
        return nbytes

    def _entry_dirs(self) -> list[Path]:
        try:
            return [path for path in self.root.iterdir() if not path.name.startswith(".") and path.is_dir()]
        except OSError as error:
            raise StorageError(f"cannot read KV store {self.root}: {error.strerror}") from None

    def _remove_abandoned(self) -> None:
        """Temporary and trash directories of processes that are gone: entries, and what was being added to an
        entry (a sparse image)."""
        for path in [*self.root.iterdir(), *(inner for entry in self._entry_dirs() for inner in _listing(entry))]:
            name = path.name
            pid = _writer_pid(name) if name.startswith((_TEMPORARY, _TRASH)) else None
            if pid is not None and not process_exists(pid):
                shutil.rmtree(path, ignore_errors=True)


def worth_an_entry(blocks: int, stored: int) -> bool:
    """Whether a prompt of `blocks` whole blocks, `stored` of them already in an entry, is stored as an entry of its
    own: when most of it is new (a question on a stored document is not worth a second copy of the document)."""
    return blocks > 2 * stored


def disk_bytes(directory: Path) -> int:
    """Bytes the files under `directory` occupy (holes not counted); 0 for what another process removed meanwhile."""
    total = 0
    for path in directory.rglob("*"):
        try:
            total += path.stat().st_blocks * 512 if path.is_file() else 0
        except FileNotFoundError:
            continue
    return total


def _listing(directory: Path) -> list[Path]:
    """What `directory` holds; nothing once another process removed it."""
    try:
        return list(directory.iterdir())
    except FileNotFoundError:
        return []


def _common_blocks(stored: list[str], keys: list[str], limit: int) -> int:
    count = 0
    for mine, theirs in zip(keys[:limit], stored):
        if mine != theirs:
            break
        count += 1
    return count


def _writer_pid(name: str) -> int | None:
    try:
        return int(name.split("-")[1])
    except (IndexError, ValueError):
        return None
