"""The first page of a KV block file: what the file holds and how it is laid out.

Binary layout of page 0 (little endian):
    magic "KVTIERKV" | format version u32 | JSON length u32 | crc32c u32 | JSON | zero padding
The crc32c covers magic, version, length and JSON. The version sits at a fixed
offset so that any later format can still be recognised and refused clearly.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ChecksumError, ConfigError, StorageError
from kvtier.storage.checksum import checksum
from kvtier.storage.geometry import PAGE, BlockLayout, KVGeometry

FORMAT_VERSION = 1
MAGIC = b"KVTIERKV"
_FIXED = struct.Struct("<8sII")  # magic, version, JSON length
_CRC = struct.Struct("<I")
_JSON_START = _FIXED.size + _CRC.size


@dataclass(frozen=True)
class FileHeader:
    """Everything page 0 records: the block layout of the data region and the model the KV belongs to."""

    layout: BlockLayout
    model_id: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "geometry": self.layout.geometry.to_dict(),
            "block_tokens": self.layout.block_tokens,
            "num_blocks": self.layout.num_blocks,
            "data_offset": self.layout.data_offset,
            "model_id": self.model_id,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FileHeader:
        layout = BlockLayout(KVGeometry.from_dict(data["geometry"]), block_tokens=data["block_tokens"],
                             num_blocks=data["num_blocks"], data_offset=data["data_offset"])
        return cls(layout=layout, model_id=data["model_id"])


def encode_header(header: FileHeader) -> bytes:
    """Page 0 of a file holding `header` (exactly PAGE bytes)."""
    body = json.dumps(header.to_dict(), sort_keys=True).encode()
    if _JSON_START + len(body) > PAGE:
        raise StorageError(f"file header is {_JSON_START + len(body)} bytes, over the {PAGE}-byte header page; "
                           f"use a shorter model id (got {len(header.model_id)} characters)")
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, len(body))
    page = fixed + _CRC.pack(checksum(fixed + body)) + body
    return page.ljust(PAGE, b"\0")


def decode_header(page: bytes, path: str) -> FileHeader:
    """The header stored in `page` (the first bytes of the file at `path`); StorageError if unusable."""
    if page[:len(MAGIC)] != MAGIC:
        raise StorageError(f"{path} is not a kvtier KV file (it starts with {page[:len(MAGIC)]!r}); "
                           "choose another path or delete the file")
    if len(page) < _JSON_START:
        raise StorageError(f"{path}: truncated header ({len(page)} bytes); delete the file and recompute")
    _, version, length = _FIXED.unpack_from(page)
    if version != FORMAT_VERSION:
        raise StorageError(f"{path} has KV file format version {version}, this kvtier reads version "
                           f"{FORMAT_VERSION}; delete the file and recompute")
    if len(page) < _JSON_START + length:
        raise StorageError(f"{path}: truncated header ({len(page)} bytes); delete the file and recompute")
    (stored_crc,) = _CRC.unpack_from(page, _FIXED.size)
    body = page[_JSON_START:_JSON_START + length]
    if checksum(page[:_FIXED.size] + body) != stored_crc:
        raise ChecksumError(f"{path}: the file header is corrupt (checksum mismatch); delete the file and recompute")
    try:
        return FileHeader.from_dict(json.loads(body))
    except (ValueError, KeyError, TypeError, ConfigError) as error:
        raise StorageError(f"{path}: the file header is unreadable ({error}); delete the file and recompute") from error
