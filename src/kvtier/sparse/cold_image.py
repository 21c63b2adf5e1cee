"""A stored sparse tier image: a placed prompt's cold pool, kept with its document KV store entry and used in place.

After the prompt of a run that publishes a document is placed (before any decode
step changes the pools), `save_image` writes into the entry's temporary directory:

    cold.kv, cold.sketch          the cold pool's K|V records and key sketches, copied region by region in the
                                  kernel (copy_file_range) at the run's own offsets
    cold.kv.crc, cold.sketch.crc  the per-page crc32c of every copied page (PageChecksums, itself checksummed)
    tables.npz                    per tiered layer: the positions in the cold slots and in the hot pool, the hit table
    image.json                    key, layouts, APP's plan, the tables' crc32c; checksummed like meta.json

Only positions the entry stores and that were pooled (not in the run's recent
window) are imaged, so the tail of a cold region past them is not part of it.
A later run of the same settings (`image_key`) opens it (`ColdImage.open`):
every file is checked before use, its cold files are read in place through
read-only descriptors (ColdPool's base; the scorer's StoredSketches) and its
hot pool is taken from the replayed prefix K/V by the stored positions.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvtier.errors import StorageError
from kvtier.sparse.record_file import RecordFile, RecordLayout
from kvtier.storage import PAGE, IOEngine, checksum, fsync_directory, write_new_file
from kvtier.storage.checksum import PageChecksums
from kvtier.storage.sealed_json import BrokenSeal, seal, unseal

log = logging.getLogger(__name__)
IMAGE_DIR = "sparse"
IMAGE_VERSION = 1
META, TABLES, KV, SKETCH, CRC = "image.json", "tables.npz", "cold.kv", "cold.sketch", ".crc"


class CorruptImage(StorageError):
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


def save_image(directory: Path, runtime, layers: list, tokens: int) -> None:
    """Write the image of the placed `layers` (SparseLayers, in tier order) for positions < `tokens`; nothing for a
    batch (a document entry holds one sequence) or an empty pool."""
    if runtime.batch != 1 or runtime.plan is None:
        return
    directory.mkdir()
    try:
        imaged = [_imaged_layer(layer, runtime, tokens) for layer in layers]
        cold = runtime.cold
        files = [(cold.kv, KV), (cold.sketches, SKETCH)]
        for file, name in files:
            runs = _copy_regions(file, directory / name, [len(layer.cold) for layer in imaged])
            write_new_file(directory / (name + CRC), file.pages.take(runs).to_bytes())
        tables = _tables_bytes(imaged)
        write_new_file(directory / TABLES, tables)
        write_new_file(directory / META, seal({
            "key": image_key(runtime), "tokens": min(_placed_until(layer, tokens) for layer in layers),
            "plan": asdict(runtime.plan), "kv_layout": cold.kv.layout.to_dict(),
            "sketch_layout": cold.sketches.layout.to_dict(), "tables_crc32c": checksum(tables)}))
        fsync_directory(directory)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


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


def _copy_regions(file: RecordFile, target: Path, counts: list[int]) -> list[tuple[int, int]]:
    """Copy each layer's first `counts[layer]` records of sequence 0 to `target` at the same offsets; the page runs."""
    layout, runs = file.layout, []
    source = os.open(file.path, os.O_RDONLY)  # buffered: copy_file_range stays in the kernel
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(fd, layout.file_bytes)  # the regions' tails stay holes
            for layer, count in enumerate(counts):
                offset, nbytes = layout.region_offset(layer, 0), layout.prefix_bytes(count)
                _copy_range(source, fd, offset, nbytes)
                runs.append((offset // PAGE, nbytes // PAGE))
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        os.close(source)
    return runs


def _copy_range(source: int, target: int, offset: int, nbytes: int) -> None:
    done = 0
    while done < nbytes:
        copied = os.copy_file_range(source, target, nbytes - done, offset + done, offset + done)
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
                 tokens: int, bytes_read: int) -> None:
        self.directory = directory
        self.plan = meta["plan"]
        self.kv_layout = RecordLayout(**meta["kv_layout"])
        self.sketch_layout = RecordLayout(**meta["sketch_layout"])
        self.layers = layers
        self.kv_pages = kv_pages
        self.tokens = tokens  # positions below this are the image's (the stored and reused prefix, pooled)
        self.bytes_read = bytes_read  # tables and checksums; the cold files are read in place, per step

    @classmethod
    def open(cls, directory: Path, key: dict, tokens: int) -> ColdImage | None:
        """The image in `directory` for a run of `key` reusing `tokens` tokens; None (with a message) when there is
        none or it was made for other settings. Raises CorruptImage when a check fails."""
        if not directory.is_dir():
            return None
        meta = _read_meta(directory / META)
        if meta["key"] != key:
            log.warning("the KV store entry's sparse image was made with other sparse settings (%s); placing the "
                        "prefix again", _difference(meta["key"], key))
            return None
        tables = _read(directory / TABLES)
        if checksum(tables) != meta["tables_crc32c"]:
            raise CorruptImage(f"{directory / TABLES}: fails its checksum")
        layers = _parse_tables(tables, key["layers"], directory)
        kv_layout, sketch_layout = RecordLayout(**meta["kv_layout"]), RecordLayout(**meta["sketch_layout"])
        kv_pages = _read_pages(directory / (KV + CRC), kv_layout)
        _read_pages(directory / (SKETCH + CRC), sketch_layout)  # the scorer loads it again; damage shows here first
        for name, layout in ((KV, kv_layout), (SKETCH, sketch_layout)):
            _check_size(directory / name, layout.file_bytes)
        read = sum((directory / name).stat().st_size for name in (META, TABLES, KV + CRC, SKETCH + CRC))
        return cls(directory, meta, layers, kv_pages, min(tokens, meta["tokens"]), read)

    def kv_file(self, io_engine: IOEngine) -> RecordFile:
        """The stored K|V records, read-only, every page read checked."""
        return RecordFile(str(self.directory / KV), self.kv_layout, io_engine, stored_pages=self.kv_pages)

    def holds(self, error: StorageError) -> bool:
        """Whether `error` is about one of this image's files (storage errors name their file first)."""
        return str(error).startswith(f"{self.directory}{os.sep}")

    def scorer_config(self) -> dict:
        """What the scorer needs to read the stored sketches (sketch_scorer.StoredSketches)."""
        return {"path": str(self.directory / SKETCH), "layout": self.sketch_layout.to_dict(),
                "pages_path": str(self.directory / (SKETCH + CRC))}


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


def _read_pages(path: Path, layout: RecordLayout) -> PageChecksums:
    try:
        return PageChecksums.from_bytes(_read(path), layout.file_bytes // PAGE)
    except ValueError as error:
        raise CorruptImage(f"{path}: {error}") from None


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
