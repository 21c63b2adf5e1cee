"""A stored sparse tier image: a placed prompt's cold pool, kept with its document KV store entry and used in place.

After the prompt of a run that publishes a document is placed (before any decode
step changes the pools), `save_image` writes into the entry's directory
`sparse-<digest of image_key>` (one per sparse settings: a document first stored by a dense run,
or by other settings, gains the image of the first sparse run that places it):

    cold.kv, cold.sketch          the cold pool's K|V records and key sketches, copied region by region in the
                                  kernel (copy_file_range) at the run's own offsets
    cold.kv.crc, cold.sketch.crc  the crc32c of every copied page (PageChecksums, read units: 512 B or 4 KiB)
    tables.npz                    per tiered layer: the positions in the cold slots and in the hot pool, the hit table
    image.json                    key, layouts, APP's plan, the tables' crc32c; checksummed like meta.json

The image is written under a temporary name and renamed, so a reader sees all of
it or none (of two runs adding one image at once, one wins). Only positions the entry stores and that were pooled (not in the run's recent
window) are imaged, so the tail of a cold region past them is not part of it.
A later run of the same settings (`image_key`) opens it (`ColdImage.open`):
every file is checked before use, its cold files are read in place through
read-only descriptors (ColdPool's base; the scorer's StoredSketches) and its
hot pool is taken from the replayed prefix K/V by the stored positions.

Such a run may publish a longer prompt (a question that extends the document)
with an image of its own: its pool's slots are still the base image's where the
channel's overlay bit is 0, so each page is copied from the base or from the
run's own file, with that file's crc; a page holding records of both is read
from both, checked in both, merged and given a new crc.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import uuid
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvtier.errors import ChecksumError, DamagedEntryError, StorageError
from kvtier.sparse.record_file import RecordFile, RecordLayout
from kvtier.storage import (
    IOEngine, checksum, direct_read_unit, fsync_directory, open_direct, round_up, write_new_file,
)
from kvtier.storage.checksum import PageChecksums
from kvtier.storage.pages import pages_holding
from kvtier.storage.sealed_json import BrokenSeal, seal, unseal

log = logging.getLogger(__name__)
IMAGE_PREFIX = "sparse-"
IMAGE_VERSION = 3  # 2: page crcs per read unit (512 B where O_DIRECT takes sectors), not per 4 KiB; 3: placed by the
# observation window's selection scores (placement.py), not its attention mass
META, TABLES, KV, SKETCH, CRC = "image.json", "tables.npz", "cold.kv", "cold.sketch", ".crc"


class CorruptImage(DamagedEntryError):
    """A stored sparse image that fails a check or is cut short: its entry is damaged."""


@dataclass
class ImagedLayer:
    """One tiered layer's placement as stored: positions ascending."""

    cold: np.ndarray  # int64 position of each cold slot 0..n-1
    hot: np.ndarray  # int64 positions in the hot pool
    hits: np.ndarray  # uint8 [tokens] hit table (hits)
    idle: np.ndarray  # uint8 [tokens] hit table (idle steps)


def image_key(runtime) -> dict:
    """What a stored image's bytes and layout depend on beyond the entry's own key (model, dtype, tokens)."""
    fmt = runtime.fmt
    return {"version": IMAGE_VERSION, "sketch": {"bits": fmt.bits, "heads": fmt.heads, "head_dim": fmt.head_dim,
                                                 "group": fmt.group},
            "dtype": str(runtime.dtype), "heads": runtime.heads, "head_dim": runtime.head_dim,
            "layers": runtime.tiered, "batch": runtime.batch, "sink": runtime.settings.sink,
            "max_hot_tokens": runtime.max_hot_tokens}


def image_name(key: dict) -> str:
    """The directory, inside a document store entry, of the image made with the settings `key` (image_key)."""
    return IMAGE_PREFIX + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def save_image(entry_dir: Path, runtime, layers: list, tokens: int) -> None:
    """Add to the store entry in `entry_dir` the image of the placed `layers` (SparseLayers, in tier order) for
    positions < `tokens`, unless it holds one for these settings; nothing for a batch (an entry holds one sequence)
    or an empty pool. A pool over a stored image (ColdPool's base) images the base's records where its slots are
    still the base's."""
    if runtime.batch != 1 or runtime.plan is None:
        return
    target = entry_dir / image_name(image_key(runtime))
    if target.exists():
        return
    if runtime.image is not None and runtime.image.kv_pages.page != runtime.cold.kv.page:
        log.warning("the stored sparse image's %d-byte pages differ from this disk's %d: the document is stored "
                    "without its sparse tiers", runtime.image.kv_pages.page, runtime.cold.kv.page)
        return
    directory = entry_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    try:
        _write_image(directory, runtime, layers, tokens)
        try:
            os.rename(directory, target)
        except OSError:
            if not target.is_dir():
                raise
            shutil.rmtree(directory)  # another run added the same image meanwhile
            return
        fsync_directory(entry_dir)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


def _write_image(directory: Path, runtime, layers: list, tokens: int) -> None:
    imaged = [_imaged_layer(layer, runtime, tokens) for layer in layers]
    cold = runtime.cold
    owned = [cold.channel.overlay[tier, 0, : len(layer.cold)].astype(bool) for tier, layer in enumerate(imaged)]
    for name, own, base in _record_files(runtime):
        pages = _copy_regions(own, base, directory / name, owned)
        write_new_file(directory / (name + CRC), pages.to_bytes())
    tables = _tables_bytes(imaged)
    write_new_file(directory / TABLES, tables)
    write_new_file(directory / META, seal({
        "key": image_key(runtime), "tokens": min(_placed_until(layer, tokens) for layer in layers),
        "plan": asdict(runtime.plan), "kv_layout": cold.kv.layout.to_dict(),
        "sketch_layout": cold.sketches.layout.to_dict(), "tables_crc32c": checksum(tables),
        "kv_page": cold.kv.page, "sketch_page": cold.sketches.page}))
    fsync_directory(directory)


def _placed_until(layer, tokens: int) -> int:
    """Positions below this were pooled at placement and are stored: the first recent-window position, or less."""
    recent = layer.window_positions[layer.sink_tokens :]
    return min(tokens, int(recent[0]) if len(recent) else layer.tokens)


def _imaged_layer(layer, runtime, tokens: int) -> ImagedLayer:
    limit = _placed_until(layer, tokens)
    cold = runtime.cold.positions[layer.tier, 0, : int(runtime.cold.used[layer.tier])].astype(np.int64)
    hot = np.sort(layer.hot.positions[0, : layer.hot.used])
    return ImagedLayer(cold[: np.searchsorted(cold, limit)], hot[hot < limit], layer.table.hits[0, :limit].copy(),
                       layer.table.idle(0, np.arange(limit)))


@dataclass
class _Records:
    """A cold-pool record file to copy from: where it is, its layout, the crc of every page; `fd` once opened."""

    path: str
    layout: RecordLayout
    pages: PageChecksums
    fd: int = -1

    def open(self, files: ExitStack) -> _Records:
        self.fd = os.open(self.path, os.O_RDONLY)  # buffered: copy_file_range stays in the kernel
        files.callback(os.close, self.fd)
        return self

    def first_page(self, layer: int) -> int:
        """The first page of `layer`'s region (sequence 0)."""
        return self.layout.region_offset(layer, 0) // self.pages.page


def _record_files(runtime) -> list[tuple[str, _Records, _Records | None]]:
    """(image file name, the pool's own file, the stored image's file under it or None) for K|V and sketches."""
    cold, image = runtime.cold, runtime.image
    return [(name, _Records(own.path, own.layout, own.pages), image.records(name) if image is not None else None)
            for name, own in ((KV, cold.kv), (SKETCH, cold.sketches))]


def _copy_regions(own: _Records, base: _Records | None, target: Path, owned: list[np.ndarray]) -> PageChecksums:
    """Copy each layer's first len(owned[layer]) records of sequence 0 to `target`, laid out as `own`: a record from
    `own` where `owned` is True, else from `base`; the target's page crcs."""
    layout, page = own.layout, own.pages.page
    pages = PageChecksums(layout.file_bytes // page, page)
    with ExitStack() as files:
        sources = {True: own.open(files), False: base.open(files) if base is not None else None}
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        files.callback(os.close, fd)
        os.ftruncate(fd, layout.file_bytes)  # the regions' tails stay holes
        for layer, mine in enumerate(owned):
            target_first = own.first_page(layer)
            for first, stop, whose in _page_runs(mine, layout.record_bytes, page):
                if whose is None:  # a page holding records of both: checked in both, merged, given a new crc
                    merged = _merged_page(own, base, layer, first, mine)
                    os.pwrite(fd, merged, (target_first + first) * page)
                    pages.record(target_first + first, pages.of(merged))
                else:  # copied whole in the kernel, with the source's crcs (checked when a reader reads it)
                    source = sources[whose]
                    source_first = source.first_page(layer) + first
                    _copy_range(source.fd, fd, source_first * page, (target_first + first) * page,
                                (stop - first) * page)
                    pages.copy(target_first + first, source.pages, source_first, stop - first)
        os.fsync(fd)
    return pages


def _page_runs(mine: np.ndarray, record_bytes: int, page: int) -> list[tuple[int, int, bool | None]]:
    """Runs (first page, stop page, True: own records only | False: the base's only | None: one page of both) over
    the `page`-byte pages holding records 0..len(mine)-1, where `mine[slot]` says whose record the slot is."""
    pages = round_up(len(mine) * record_bytes, page) // page

    def touched(slots: np.ndarray) -> np.ndarray:
        held = np.zeros(pages, dtype=bool)
        held[pages_holding(slots, record_bytes, max_gap=0, page=page)] = True
        return held

    has_own, has_base = touched(np.flatnonzero(mine)), touched(np.flatnonzero(~mine))
    kind = np.where(has_own & has_base, 2, has_own.astype(np.int64))  # 0 base, 1 own, 2 both
    edges = [0, *(np.flatnonzero(np.diff(kind)) + 1).tolist(), pages] if pages else []
    runs = []
    for start, stop in zip(edges, edges[1:]):
        if kind[start] == 2:
            runs.extend((number, number + 1, None) for number in range(start, stop))
        else:
            runs.append((start, stop, bool(kind[start])))
    return runs


def _merged_page(own: _Records, base: _Records, layer: int, page: int, mine: np.ndarray) -> np.ndarray:
    """Page `page` of `layer`'s region from both files' pages (each checked): every record's bytes from its file."""
    own_bytes, base_bytes = _checked_page(own, layer, page), _checked_page(base, layer, page)
    size = own.pages.page
    slot = (page * size + np.arange(size)) // own.layout.record_bytes  # the slot of each byte of the page
    take_own = (slot < len(mine)) & mine[np.minimum(slot, len(mine) - 1)]
    return np.where(take_own, own_bytes, base_bytes)


def _checked_page(records: _Records, layer: int, page: int) -> np.ndarray:
    number, size = records.first_page(layer) + page, records.pages.page
    data = np.frombuffer(os.pread(records.fd, size, number * size), dtype=np.uint8)
    problem = records.pages.mismatch_at(np.array([number]), data)
    if problem is not None:
        raise ChecksumError(f"{records.path}: cold records of layer {layer}: {problem}; the file is damaged")
    return data


def _copy_range(source: int, target: int, source_offset: int, target_offset: int, nbytes: int) -> None:
    done = 0
    while done < nbytes:
        copied = os.copy_file_range(source, target, nbytes - done, source_offset + done, target_offset + done)
        if copied == 0:
            raise OSError(0, "the cold-pool file ended before its records did")
        done += copied


def _tables_bytes(imaged: list[ImagedLayer]) -> bytes:
    arrays = {f"{name}{index}": getattr(layer, name) for index, layer in enumerate(imaged)
              for name in ("cold", "hot", "hits", "idle")}
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


class ColdImage:
    """A stored image opened for reuse: its tables in memory, its cold files checked and read in place."""

    def __init__(self, directory: Path, meta: dict, layers: list[ImagedLayer], kv_pages: PageChecksums,
                 sketch_pages: PageChecksums, tokens: int, bytes_read: int) -> None:
        self.directory = directory
        self.plan = meta["plan"]
        self.kv_layout = RecordLayout(**meta["kv_layout"])
        self.sketch_layout = RecordLayout(**meta["sketch_layout"])
        self.layers = layers
        self.kv_pages = kv_pages
        self.sketch_pages = sketch_pages  # the scorer reads the sketches; a run storing an image copies them
        self.tokens = tokens  # positions below this are the image's (the stored and reused prefix, pooled)
        self.bytes_read = bytes_read  # tables and checksums; the cold files are read in place, per step

    @classmethod
    def open(cls, entry_dir: Path, key: dict, tokens: int) -> ColdImage | None:
        """The image in the store entry `entry_dir` for a run of `key` reusing `tokens` tokens; None (with a
        message) when the entry holds none for these settings. Raises CorruptImage when a check fails."""
        directory = entry_dir / image_name(key)
        if not directory.is_dir():
            log.info("KV store entry %s holds no sparse tiers for these settings yet: the document is placed afresh "
                     "and they are stored with it", entry_dir.name)
            return None
        meta = _read_meta(directory / META)
        if meta["key"] != key:
            raise CorruptImage(f"{directory / META}: made for other sparse settings ({_difference(meta['key'], key)})")
        tables = _read(directory / TABLES)
        if checksum(tables) != meta["tables_crc32c"]:
            raise CorruptImage(f"{directory / TABLES}: fails its checksum")
        layers = _parse_tables(tables, key["layers"], directory)
        kv_layout, sketch_layout = RecordLayout(**meta["kv_layout"]), RecordLayout(**meta["sketch_layout"])
        kv_pages = _read_pages(directory / (KV + CRC), kv_layout, meta["kv_page"])
        sketch_pages = _read_pages(directory / (SKETCH + CRC), sketch_layout, meta["sketch_page"])  # the scorer's too
        for name, layout in ((KV, kv_layout), (SKETCH, sketch_layout)):
            _check_size(directory / name, layout.file_bytes)
        unit = _read_unit(directory / KV)
        if meta["kv_page"] % unit:
            log.warning("the KV store entry's sparse image has %d-byte pages, which O_DIRECT cannot read here (%d); "
                        "placing the prefix again", meta["kv_page"], unit)
            return None
        read = sum((directory / name).stat().st_size for name in (META, TABLES, KV + CRC, SKETCH + CRC))
        return cls(directory, meta, layers, kv_pages, sketch_pages, min(tokens, meta["tokens"]), read)

    def kv_file(self, io_engine: IOEngine) -> RecordFile:
        """The stored K|V records, read-only, every page read checked."""
        return RecordFile(str(self.directory / KV), self.kv_layout, io_engine, stored_pages=self.kv_pages)

    def records(self, name: str) -> _Records:
        """The stored file `name` (KV or SKETCH) to copy records from."""
        layout, pages = (self.kv_layout, self.kv_pages) if name == KV else (self.sketch_layout, self.sketch_pages)
        return _Records(str(self.directory / name), layout, pages)

    def holds(self, error: StorageError) -> bool:
        """Whether `error` is about one of this image's files (storage errors name their file first)."""
        return str(error).startswith(f"{self.directory}{os.sep}")

    def scorer_config(self, name: str) -> dict:
        """What the scorer needs to read the stored file `name` in place: SKETCH, the sketches it scores
        (stored_sketches.py); KV, the lookahead's candidates (scorer_process.py). See record_file.stored_pages."""
        records = self.records(name)
        return {"path": records.path, "layout": records.layout.to_dict(),
                "pages_path": str(self.directory / (name + CRC)), "page": records.pages.page}


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CorruptImage(f"{path}: missing") from None


def _read_meta(path: Path) -> dict:
    try:
        return unseal(_read(path))
    except BrokenSeal as error:
        raise CorruptImage(f"{path}: {error}") from None
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptImage(f"{path}: unreadable ({error.__class__.__name__})") from None


def _parse_tables(data: bytes, layers: int, directory: Path) -> list[ImagedLayer]:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            return [ImagedLayer(*(arrays[f"{name}{index}"] for name in ("cold", "hot", "hits", "idle")))
                    for index in range(layers)]
    except (ValueError, KeyError, OSError) as error:
        raise CorruptImage(f"{directory / TABLES}: unreadable ({error.__class__.__name__})") from None


def _read_pages(path: Path, layout: RecordLayout, page: int) -> PageChecksums:
    try:
        return PageChecksums.from_bytes(_read(path), layout.file_bytes, page)
    except ValueError as error:
        raise CorruptImage(f"{path}: {error}") from None


def _read_unit(path: Path) -> int:
    """The read unit O_DIRECT takes for the stored file at `path` (direct_file.direct_read_unit)."""
    fd, direct = open_direct(path, os.O_RDONLY)
    try:
        return direct_read_unit(fd, direct)
    finally:
        os.close(fd)


def _check_size(path: Path, expected: int) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CorruptImage(f"{path}: missing") from None
    if size != expected:
        raise CorruptImage(f"{path}: truncated ({size} bytes of {expected})")


def _difference(stored: dict, wanted: dict) -> str:
    return ", ".join(f"{name} {stored.get(name)} instead of {wanted[name]}" for name in wanted
                     if stored.get(name) != wanted[name])
