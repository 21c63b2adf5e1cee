"""A file of fixed-size K/V blocks on the SSD, checksummed, read and written with direct I/O.

File layout (every region starts on a 4 KiB page):
    page 0            header (header.py): format version, geometry, block size, capacity, model id
    page 1 ...        checksum table (checksum.py): one (crc32c, written) entry per block slot
    data_offset ...   data region (geometry.BlockLayout): per layer all K blocks, then all V blocks

The file has one writer: `create` and `open` take its lock (file_lock.py) before touching it, and a
second process asking for the same path gets an error naming the first one's pid.

Blocks adjacent on disk (consecutive slots, also across K/V and layer
boundaries) are moved by one vectored syscall; the runs go to the I/O engine's
threads. Every write records the block's crc32c only after its data is on
disk, and every read verifies it.

Buffers are any contiguous bytes (numpy arrays, bytearrays, CPU tensors viewed
as uint8). O_DIRECT needs page-aligned buffers; other buffers, and every block
when block_bytes is not a multiple of 4 KiB, are copied through an aligned
bounce buffer (counted in `io.stats.bounce_copies`). Choose block_tokens so
blocks fill whole pages and pass `aligned_buffer`s to move data without copies.

Readers that want a few tokens of many blocks read single pages (`read_pages`),
of the file's read unit (`page_bytes`: 512 where O_DIRECT takes sectors, else
4 KiB): a file created with `page_checksums=True` also keeps, in memory, a
crc32c of every such page it writes, and checks each page read against it.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import ChecksumError, ConfigError, StorageError
from kvtier.storage import direct_file
from kvtier.storage.aligned import aligned_buffer, byte_view, is_aligned
from kvtier.storage.checksum import ChecksumTable, PageChecksums, checksum
from kvtier.storage.file_lock import FileLock
from kvtier.storage.geometry import KIND_NAMES, PAGE, BlockLayout, KVGeometry
from kvtier.storage.header import FileHeader, decode_header, encode_header
from kvtier.storage.io_engine import IOEngine, Run, consecutive_spans, then
from kvtier.units import format_size

BlockRequest = tuple[int, int, int, Any]  # (layer, kind, block, buffer of layout.block_bytes)
# (layer, kind, first block, sorted page numbers counted from that block's start, buffer from that block's start)
PageRequest = tuple[int, int, int, np.ndarray, np.ndarray]
TABLE_OFFSET = PAGE


@dataclass(frozen=True)
class _Block:
    """One block of a read or write request, with the caller's buffer as flat bytes."""

    layer: int
    kind: int
    block: int
    slot: int
    data: np.ndarray

    def describe(self) -> str:
        return f"layer {self.layer} {KIND_NAMES[self.kind]} block {self.block}"


class KVBlockFile:
    """An open KV block file. Use `create` or `open`, then `write_blocks` / `read_blocks`."""

    def __init__(self, path: str, fd: int, lock: FileLock, direct: bool, header: FileHeader, table: ChecksumTable,
                 io: IOEngine, owns_io: bool, pages: PageChecksums | None = None) -> None:
        self.path = path
        self._lock = lock
        self.layout: BlockLayout = header.layout
        self.model_id = header.model_id
        self.direct = direct
        self.io = io
        self._fd = fd
        self._table = table
        self._owns_io = owns_io
        self._table_lock = threading.Lock()
        self._pages = pages

    # ----- creating and opening -----

    @classmethod
    def create(cls, path: str | os.PathLike[str], geometry: KVGeometry, block_tokens: int, num_blocks: int,
               model_id: str, io: IOEngine | None = None, page_checksums: bool = False) -> KVBlockFile:
        """A new, preallocated file for `num_blocks` blocks per layer and kind; replaces any file at `path`.

        `page_checksums`: keep the per-page crcs that `read_pages` needs (blocks must fill whole pages).
        """
        path = os.fspath(path)
        _check_directory(os.path.dirname(os.path.abspath(path)))
        num_slots = BlockLayout(geometry, block_tokens, num_blocks).num_slots
        layout = BlockLayout(geometry, block_tokens, num_blocks,
                             data_offset=TABLE_OFFSET + ChecksumTable.nbytes_for(num_slots))
        if page_checksums and not layout.fills_pages:
            raise ConfigError(f"page checksums need blocks that fill whole pages; a block of {block_tokens} tokens "
                              f"holds {layout.block_bytes} bytes")
        header = FileHeader(layout, model_id)
        page = encode_header(header)  # before touching the disk, so a bad header leaves no file behind
        lock = FileLock.acquire(path, "KV file")  # before replacing anything: another process may be using it
        try:
            if os.path.lexists(path):
                _unlink(path)  # a stale file (its writer is gone): our own copy replaces it
            fd, direct = _open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        except BaseException:
            lock.release()
            raise
        try:
            _preallocate(fd, path, layout.file_bytes)
            _write_page(fd, path, page)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            lock.release()
            raise
        engine = io or IOEngine()
        pages = _page_checksums(fd, direct, layout) if page_checksums else None
        return cls(path, fd, lock, direct, header, ChecksumTable(layout.num_slots), engine, owns_io=io is None,
                   pages=pages)

    @classmethod
    def open(cls, path: str | os.PathLike[str], geometry: KVGeometry | None = None, block_tokens: int | None = None,
             model_id: str | None = None, io: IOEngine | None = None) -> KVBlockFile:
        """An existing file, checked against what the caller expects (None: accept what the file holds)."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise StorageError(f"{path}: no such KV file; create it first or check the path")
        lock = FileLock.acquire(path, "KV file")
        try:
            fd, direct = _open(path, os.O_RDWR)
        except BaseException:
            lock.release()
            raise
        engine = io or IOEngine()
        try:
            header = decode_header(_read_page(fd, path), path)
            _check_expected(path, header, geometry, block_tokens, model_id)
            _check_size(fd, path, header.layout)
            table = ChecksumTable(header.layout.num_slots)
            engine.read_runs(fd, [(TABLE_OFFSET, [table.pages(0, table.nbytes // PAGE)])])
        except BaseException:
            os.close(fd)
            lock.release()
            if io is None:
                engine.close()
            raise
        return cls(path, fd, lock, direct, header, table, engine, owns_io=io is None)

    @property
    def page_checksums(self) -> bool:
        """Whether this object keeps page crcs, so that `read_pages` works."""
        return self._pages is not None

    @property
    def page_bytes(self) -> int:
        """The size of the pages `read_pages` moves (the file's read unit); only with page checksums."""
        return self._pages.page

    # ----- block I/O -----

    def write_blocks(self, blocks: Sequence[BlockRequest]) -> None:
        """Write each (layer, kind, block, buffer) and record its checksum."""
        requests = self._requests(blocks, for_read=False)
        if len({request.slot for request in requests}) != len(requests):
            raise ValueError("write_blocks got the same block twice in one call; pass each block once")
        crcs = [checksum(request.data) for request in requests]
        page_crcs = [self._pages.of(request.data) for request in requests] if self._pages is not None else []
        runs, staged = self._plan_runs(requests)
        for request, staging in staged:
            staging[:] = request.data
        self.io.stats.add(bounce_copies=len(staged))
        self.io.write_runs(self._fd, runs)
        self._record_checksums(requests, crcs)  # only now: data must never look valid before it is on disk
        for request, crcs_of_pages in zip(requests, page_crcs):
            self._pages.record(request.slot * self.layout.block_stride // self._pages.page, crcs_of_pages)

    def read_blocks(self, blocks: Sequence[BlockRequest]) -> None:
        """Fill each (layer, kind, block, out buffer) from the file and verify its checksum."""
        self._read_now(*self._prepare_read(blocks))

    def submit_read_blocks(self, blocks: Sequence[BlockRequest]) -> Future[None]:
        """`read_blocks` in the background (e.g. prefetching the next layer); `.result()` raises its errors."""
        return self._read_later(*self._prepare_read(blocks))

    def _prepare_read(self, blocks: Sequence[BlockRequest]) -> tuple[list[Run], Callable[[], None]]:
        requests = self._requests(blocks, for_read=True)
        runs, staged = self._plan_runs(requests)

        def finish() -> None:
            for request, staging in staged:
                request.data[:] = staging
            self.io.stats.add(bounce_copies=len(staged))
            for request in requests:
                self._verify(request)

        return runs, finish

    def read_pages(self, requests: Sequence[PageRequest]) -> None:
        """Fill chosen pages of runs of adjacent blocks and check each against its recorded crc.

        Page p of a request is the p-th `page_bytes` page from its first block's start (it may lie in a
        later block of the same layer and kind) and lands at bytes [p * page_bytes, (p + 1) * page_bytes) of
        the request's buffer, which must be page-aligned under O_DIRECT. Adjacent pages move in one syscall.
        """
        runs, finish = self._prepare_page_read(requests)
        self.io.read_runs_batched(self._fd, runs)  # scattered pages: one kernel AIO batch, as the sparse path reads
        finish()

    def submit_read_pages(self, requests: Sequence[PageRequest]) -> Future[None]:
        """`read_pages` in the background; `.result()` raises its errors."""
        return self._read_later(*self._prepare_page_read(requests))

    def _read_now(self, runs: list[Run], finish: Callable[[], None]) -> None:
        """Read the runs, then copy out and verify (`finish`)."""
        self.io.read_runs(self._fd, runs)
        finish()

    def _read_later(self, runs: list[Run], finish: Callable[[], None]) -> Future[None]:
        """`_read_now` on the I/O threads; the future raises what reading or `finish` raised."""
        return then(self.io.submit_read_runs(self._fd, runs), finish)

    def _prepare_page_read(self, requests: Sequence[PageRequest]) -> tuple[list[Run], Callable[[], None]]:
        if self._pages is None:
            raise StorageError(f"{self.path}: page reads need page checksums; create the file with "
                               "page_checksums=True")
        runs, checks, page = [], [], self._pages.page
        for layer, kind, block, pages, buffer in requests:
            data = byte_view(buffer)
            first_byte = self.layout.slot(layer, kind, block) * self.layout.block_stride
            self._check_page_request(layer, kind, block, pages, data)
            for span in consecutive_spans(pages.tolist()):
                start, stop = int(pages[span.start]) * page, (int(pages[span.stop - 1]) + 1) * page
                runs.append((self.layout.data_offset + first_byte + start, [memoryview(data[start:stop])]))
                checks.append((first_byte + start, data[start:stop], (layer, kind, block)))

        def finish() -> None:
            for offset, data, (layer, kind, block) in checks:
                problem = self._pages.mismatch(offset, data)
                if problem:
                    raise ChecksumError(f"{self.path}: {problem} (layer {layer} {KIND_NAMES[kind]} from block "
                                        f"{block}); the file is damaged or the page was never stored: delete it and "
                                        "recompute")

        return runs, finish

    def _check_page_request(self, layer: int, kind: int, block: int, pages: np.ndarray, data: np.ndarray) -> None:
        if not pages.size:
            return
        last, page = int(pages[-1]) + 1, self._pages.page
        stride = self.layout.block_stride
        if pages[0] < 0 or block * stride + last * page > self.layout.num_blocks * stride:
            raise ValueError(f"layer {layer} {KIND_NAMES[kind]}: pages {int(pages[0])}..{last - 1} from block {block} "
                             f"run past the last block ({self.layout.num_blocks})")
        if data.nbytes < last * page or not data.flags.writeable or (self.direct and not is_aligned(data, page)):
            raise ValueError(f"layer {layer} {KIND_NAMES[kind]}: the buffer must be writable, page-aligned and "
                             f"hold {last} pages, got {data.nbytes} bytes")

    def _requests(self, blocks: Sequence[BlockRequest], for_read: bool) -> list[_Block]:
        requests = []
        for layer, kind, block, buffer in blocks:
            request = _Block(layer, kind, block, self.layout.slot(layer, kind, block), byte_view(buffer))
            if request.data.nbytes != self.layout.block_bytes:
                raise ValueError(f"{request.describe()}: buffer has {request.data.nbytes} bytes, "
                                 f"a block has {self.layout.block_bytes}")
            if for_read and not request.data.flags.writeable:
                raise ValueError(f"{request.describe()}: the output buffer is read-only")
            requests.append(request)
        return sorted(requests, key=lambda request: request.slot)

    def _plan_runs(self, requests: list[_Block]) -> tuple[list[Run], list[tuple[_Block, np.ndarray]]]:
        """One run per span of adjacent slots, and the (request, staging area) pairs that need a bounce copy.

        A block is staged in an aligned buffer when O_DIRECT cannot use the caller's buffer, or when
        its payload is shorter than its stride (the run must cover the padding between blocks).
        """
        stride, payload = self.layout.block_stride, self.layout.block_bytes
        slots = [request.slot for request in requests]
        runs: list[Run] = []
        staged: list[tuple[_Block, np.ndarray]] = []
        for span in consecutive_spans(slots):
            group = requests[span]
            bounce = [self._needs_bounce(request.data) for request in group]
            areas = iter(aligned_buffer(sum(bounce) * stride).reshape(-1, stride) if any(bounce) else ())
            buffers = []
            for request, bounced in zip(group, bounce):
                if bounced:
                    area = next(areas)
                    staged.append((request, area[:payload]))
                    buffers.append(memoryview(area))
                else:
                    buffers.append(memoryview(request.data))
            runs.append((self.layout.data_offset + group[0].slot * stride, buffers))
        return runs, staged

    def _needs_bounce(self, data: np.ndarray) -> bool:
        return self.layout.block_bytes != self.layout.block_stride or (self.direct and not is_aligned(data))

    def _record_checksums(self, requests: list[_Block], crcs: list[int]) -> None:
        with self._table_lock:  # concurrent writers must not persist a page while another edits it
            pages = sorted({self._table.record(request.slot, crc) for request, crc in zip(requests, crcs)})
            runs = [(TABLE_OFFSET + pages[span.start] * PAGE, [self._table.pages(pages[span.start], len(pages[span]))])
                    for span in consecutive_spans(pages)]
            self.io.write_runs(self._fd, runs)

    def _verify(self, request: _Block) -> None:
        stored = self._table.stored_crc(request.slot)
        if stored is None:
            raise StorageError(f"{self.path}: {request.describe()} was never written; write it before reading it")
        found = checksum(request.data)
        if found != stored:
            raise ChecksumError(f"{self.path}: checksum mismatch in {request.describe()} "
                                f"(stored 0x{stored:08x}, read 0x{found:08x}); the file is damaged: "
                                "delete it and recompute")

    # ----- housekeeping -----

    def drop_page_cache(self) -> None:
        """Evict this file from the page cache so the next reads hit the disk (a no-op in effect when direct)."""
        direct_file.drop_page_cache(self._fd)

    def close(self) -> None:
        """Close the file and give up its lock (idempotent)."""
        self._close(remove=False)

    def remove(self) -> None:
        """Close the file and delete it from the disk, then give up its lock (no other writer sees it half gone)."""
        self._close(remove=True)

    def _close(self, remove: bool) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            if self._owns_io:
                self.io.close()
        if remove and self._lock.held and os.path.exists(self.path):
            os.unlink(self.path)
        self._lock.release()

    def __enter__(self) -> KVBlockFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _page_checksums(fd: int, direct: bool, layout: BlockLayout) -> PageChecksums:
    """An empty table of the data region's page crcs, in the pages `fd` reads (direct_file.direct_read_unit)."""
    unit = direct_file.direct_read_unit(fd, direct)
    return PageChecksums(layout.data_bytes // unit, unit)


def _check_directory(directory: str) -> None:
    if not os.path.isdir(directory):
        raise StorageError(f"directory {directory} does not exist; create it or choose another KV directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise StorageError(f"directory {directory} is not writable; fix its permissions or choose another")


def _open(path: str, flags: int) -> tuple[int, bool]:
    try:
        return direct_file.open_direct(path, flags)
    except OSError as error:
        raise StorageError(f"{path}: cannot open the KV file: {error.strerror}") from error


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError as error:
        raise StorageError(f"{path}: cannot replace the existing file: {error.strerror}") from error


def _preallocate(fd: int, path: str, nbytes: int) -> None:
    """Reserve all blocks now, so a full disk fails at creation rather than in the middle of a run."""
    directory = os.path.dirname(os.path.abspath(path))
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageError(f"not enough space in {directory}: need {format_size(nbytes)}, have "
                               f"{format_size(free)} free; free some space or lower the storage budget") from error
        raise StorageError(f"{path}: cannot reserve {format_size(nbytes)}: {error.strerror}") from error


def _write_page(fd: int, path: str, data: bytes) -> None:
    page = aligned_buffer(PAGE)
    page[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    try:
        os.pwrite(fd, page, 0)
    except OSError as error:
        raise StorageError(f"{path}: cannot write the file header: {error.strerror}") from error


def _read_page(fd: int, path: str) -> bytes:
    """The first page of the file, or all of it if shorter (the header decoder reports that)."""
    page = aligned_buffer(PAGE)
    try:
        nbytes = os.preadv(fd, [page], 0)
    except OSError as error:
        raise StorageError(f"{path}: cannot read the file header: {error.strerror}") from error
    return page[:nbytes].tobytes()


def _check_expected(path: str, header: FileHeader, geometry: KVGeometry | None, block_tokens: int | None,
                    model_id: str | None) -> None:
    """StorageError listing every field where the file differs from what the caller expects."""
    found = header.layout
    pairs: list[tuple[str, object, object]] = []
    if geometry is not None:
        pairs += [(name, found_value, geometry.to_dict()[name])
                  for name, found_value in found.geometry.to_dict().items()]
    if block_tokens is not None:
        pairs.append(("block_tokens", found.block_tokens, block_tokens))
    if model_id is not None:
        pairs.append(("model_id", header.model_id, model_id))
    differences = [f"{name} is {found_value!r} in the file but {expected!r} was expected"
                   for name, found_value, expected in pairs if found_value != expected]
    if differences:
        raise StorageError(f"{path} holds a different KV cache: {'; '.join(differences)}; "
                           "delete it or point to the file made for this model and settings")


def _check_size(fd: int, path: str, layout: BlockLayout) -> None:
    size = os.fstat(fd).st_size
    if size < layout.file_bytes:
        raise StorageError(f"{path} is truncated: {size} bytes, but its header describes {layout.file_bytes}; "
                           "delete it and recompute")
