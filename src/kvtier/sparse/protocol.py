"""The host <-> storage-scorer protocol: one shared-memory segment and two pipes.

Hot path per layer and step (one round trip per layer and step, so it must be cheap): the host
writes the query into one of AREAS request areas of shared memory and one 40-byte request into
the request pipe; the scorer writes `<position, score>` score blocks of n tokens into that area's
results, bumping a per-sequence block counter after each block, and answers with one 16-byte
message on the response pipe. No arrays are pickled and nothing is copied through a pipe, so a
round trip costs two pipe wake-ups.

Requests take the areas in turn, so the host may send requests while the scorer still works on
earlier ones (the lookahead asks for the next layers' candidates while layer l's are read): the
scorer answers in order, and an area is written again only AREAS requests later, once the host
is done with what its answer left there.

The segment is an anonymous memfd: it has no name to leak or to be unlinked
by another process's resource tracker, and a restarted scorer inherits it.

A candidates request (the lookahead's, lookahead.py) asks for more: the
scorer also takes each sequence's `counts[seq]` best-scored slots, reads their
full-precision K|V records from the K|V file, checks every page read against
the crcs the host keeps here (`kv_crcs`, written by the host as it writes the
file), and puts them into its area's `found_*`.

Segment layout (all views are numpy arrays over one mmap; A = AREAS request areas):
    control    int64 [8]                    scorer bytes read, candidate bytes read (cumulative, scorer-written)
    progress   int64 [A, batch]             score blocks finished for the area's request
    versions   int64 [layers]               bumped by the host whenever it rewrites a layer's sketches
    cold_used  int64 [layers]               cold tokens per sequence of each layer (host-written, before the version)
    query      float32 [A, batch, heads, q_per_head, head_dim]
    positions  int32 [layers, batch, slots] token position held by each cold slot (host-written)
    overlay    uint8 [layers, batch, slots] 1: the slot was written by this run, 0: still a stored image's
    results    (position int32, score float32) [A, batch, slots]
    counts     int64 [A, batch]             candidates wanted per sequence (a candidates request)
    kv_crcs    uint32 [kv_pages]            crc32c of each 512-byte unit of the K|V file (as many as its read
    kv_written bool [kv_pages]              units need), and whether it was written
    found_slots   int64 [A, batch, candidates]               the candidates' slots, ascending
    found_records uint8 [A, batch, candidates, kv_record]    their verified K|V records
    found_bytes   int64 [A, batch]                           bytes read for them
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np

from kvtier.sparse.record_file import RecordLayout
from kvtier.storage import SECTOR
from kvtier.storage.checksum import PageChecksums

RESPONSE = struct.Struct("<qq")  # request id, status
OP_SCORE, OP_STOP, OP_CANDIDATES = 1, 2, 3
STATUS_OK, STATUS_FAILED = 0, 1
AREAS = 4  # requests unanswered at once: the layer attending and the lookahead's three (lookahead.MAX_AHEAD)
CONTROL_SCORER_READ_BYTES = 0  # cumulative sketch bytes the scorer (or the host fallback) read from disk
CONTROL_CANDIDATE_READ_BYTES = 1  # cumulative K|V bytes read for candidates
RESULT_DTYPE = np.dtype([("position", "<i4"), ("score", "<f4")])


@dataclass(frozen=True)
class Request:
    """One request: score `layer`'s `cold_tokens` cold tokens per sequence with the query in request area `area`
    (and, for OP_CANDIDATES, read the best candidates into it)."""

    id: int
    layer: int
    op: int
    cold_tokens: int = 0
    area: int = 0

    FORMAT: ClassVar[struct.Struct] = struct.Struct("<qqqqq")

    def pack(self) -> bytes:
        return self.FORMAT.pack(self.id, self.layer, self.op, self.cold_tokens, self.area)

    @classmethod
    def unpack(cls, message: bytes) -> Request:
        return cls(*cls.FORMAT.unpack(message))


@dataclass(frozen=True)
class ChannelSpec:
    """Shapes of the shared arrays; sent to the scorer as JSON at start-up."""

    batch: int
    layers: int
    heads: int
    q_per_head: int
    head_dim: int
    slots: int
    kv_record_bytes: int = 0  # a K|V record's size; 0: no candidates requests
    candidates: int = 0  # the most candidates a sequence may ask for

    @property
    def kv_pages(self) -> int:
        """crc entries for the K|V file in its smallest read unit (a coarser unit uses a prefix of them)."""
        return RecordLayout(self.kv_record_bytes, self.layers, self.batch, self.slots).file_bytes // SECTOR

    def shapes(self) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
        found = (AREAS, self.batch, self.candidates)
        return [
            ("control", np.dtype(np.int64), (8,)),
            ("progress", np.dtype(np.int64), (AREAS, self.batch)),
            ("versions", np.dtype(np.int64), (self.layers,)),
            ("cold_used", np.dtype(np.int64), (self.layers,)),
            ("query", np.dtype(np.float32), (AREAS, self.batch, self.heads, self.q_per_head, self.head_dim)),
            ("positions", np.dtype(np.int32), (self.layers, self.batch, self.slots)),
            ("overlay", np.dtype(np.uint8), (self.layers, self.batch, self.slots)),
            ("results", RESULT_DTYPE, (AREAS, self.batch, self.slots)),
            ("counts", np.dtype(np.int64), (AREAS, self.batch)),
            ("kv_crcs", np.dtype(np.uint32), (self.kv_pages,)),
            ("kv_written", np.dtype(np.bool_), (self.kv_pages,)),
            ("found_slots", np.dtype(np.int64), found),
            ("found_records", np.dtype(np.uint8), (*found, self.kv_record_bytes)),
            ("found_bytes", np.dtype(np.int64), (AREAS, self.batch)),
        ]

    @property
    def nbytes(self) -> int:
        return sum(_aligned(dtype.itemsize * int(np.prod(shape))) for _, dtype, shape in self.shapes())

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64  # each array on its own cache line


class Channel:
    """Numpy views of the shared segment behind `fd` (created by the host, inherited by the scorer)."""

    def __init__(self, spec: ChannelSpec, fd: int) -> None:
        self.spec = spec
        self.fd = fd
        self._map = mmap.mmap(fd, max(spec.nbytes, 1))
        offset = 0
        for name, dtype, shape in spec.shapes():
            count = int(np.prod(shape))
            setattr(self, name, np.frombuffer(self._map, dtype=dtype, count=count, offset=offset).reshape(shape))
            offset += _aligned(dtype.itemsize * count)

    @classmethod
    def create(cls, spec: ChannelSpec) -> Channel:
        fd = os.memfd_create("kvtier-scorer", 0)  # inheritable only where passed explicitly (pass_fds)
        os.ftruncate(fd, max(spec.nbytes, 1))
        return cls(spec, fd)

    def kv_checksums(self, num_pages: int, page: int) -> PageChecksums:
        """The K|V file's page crcs in this segment, for `num_pages` pages of `page` bytes: the host records them as
        it writes, the scorer checks the candidates it reads against them."""
        units = self.spec.kv_pages * SECTOR // page
        if num_pages > units:
            raise ValueError(f"the channel holds crcs for {units} pages of {page} bytes, not {num_pages}")
        return PageChecksums.over(self.kv_crcs[:units], self.kv_written[:units], page)

    def close(self) -> None:
        for name, _, _ in self.spec.shapes():
            setattr(self, name, None)  # release the views before the map
        try:
            self._map.close()
        except BufferError:
            pass  # a view lives on (candidates held by a failed step's traceback): unmapped when the last one goes
        if self.fd >= 0:
            os.close(self.fd)  # the segment's memory is freed once no descriptor or mapping holds it
            self.fd = -1


def read_exact(fd: int, size: int) -> bytes:
    """`size` bytes from a pipe, or b"" at end of file (the other side is gone)."""
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return b""
        data += chunk
    return data
