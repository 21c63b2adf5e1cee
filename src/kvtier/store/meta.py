"""An entry's meta.json: identity, chained block keys, the layers' shapes and every record's crc32c.

Read without torch, so `kvtier store list` answers at once. The file carries a
crc32c of its own body: a damaged meta.json is a damaged entry, never a guess.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.errors import StorageError
from kvtier.storage import PAGE, checksum, round_up

META, KV = "meta.json", "kv.bin"
ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class CorruptEntry(StorageError):
    """A stored entry that fails its checksums or is cut short: never used."""


@dataclass
class EntryMeta:
    """What meta.json says about an entry."""

    identity: dict
    identity_digest: str
    document: str  # first block's tokens alone (keys.document_key)
    block_tokens: int
    blocks: list[str]  # chained block keys, one per stored block
    layers: list[list[int]]  # [heads, head_dim] per layer
    dtype: str
    crc32c: list[int]  # per record, in file order
    head: str  # the document's first characters, for `kvtier store list`
    created: float

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block_tokens

    def record_bytes(self, layer: int) -> int:
        heads, head_dim = self.layers[layer]
        return self.block_tokens * heads * head_dim * ITEM_BYTES[self.dtype]

    def record_span(self, layer: int) -> int:
        return round_up(self.record_bytes(layer), PAGE)

    @property
    def block_span(self) -> int:
        return sum(2 * self.record_span(layer) for layer in range(len(self.layers)))

    def layer_offset(self, block: int, layer: int) -> int:
        """File offset of `layer`'s K record in `block` (its V record follows)."""
        return block * self.block_span + sum(2 * self.record_span(earlier) for earlier in range(layer))

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.block_span

    def to_bytes(self) -> bytes:
        body = json.dumps(asdict(self), sort_keys=True)
        return json.dumps({"body": body, "crc32c": checksum(body.encode())}).encode()

    @classmethod
    def parse(cls, data: bytes, where: Path) -> EntryMeta:
        try:
            wrapper = json.loads(data)
            body = wrapper["body"]
            if checksum(body.encode()) != wrapper["crc32c"]:
                raise CorruptEntry(f"{where}: fails its checksum")
            return cls(**json.loads(body))
        except (ValueError, KeyError, TypeError) as error:
            raise CorruptEntry(f"{where}: unreadable ({error.__class__.__name__})") from None


def read_meta(directory: Path) -> EntryMeta:
    path = directory / META
    try:
        return EntryMeta.parse(path.read_bytes(), path)
    except FileNotFoundError:
        raise CorruptEntry(f"{path}: missing") from None


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
