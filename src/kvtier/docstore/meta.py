"""An entry's meta.json: identity, chained block keys, the layers' shapes and every record's crc32c.

Read without torch, so `kvtier store list` answers at once. The file carries a
crc32c of its own body: a damaged meta.json is a damaged entry, never a guess.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

from kvtier.errors import DamagedEntryError, StorageError
from kvtier.storage import PAGE
from kvtier.storage.sealed_json import BrokenSeal, seal, unseal

META, KV = "meta.json", "kv.bin"
ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class CorruptEntry(DamagedEntryError):
    """A stored entry that fails its checksums or is cut short: never used."""


@dataclass
class EntryMeta:
    """What meta.json says about an entry (entry.py has the layout these offsets describe)."""

    identity: dict
    identity_digest: str
    document: str  # first block's tokens alone (keys.document_key)
    block_tokens: int
    blocks: list[str]  # chained block keys, one per stored block
    layers: list[list[int]]  # [heads, head_dim] per layer
    dtype: str
    crc32c: list[int]  # per record (record_index)
    head: str  # the document's first characters, for `kvtier store list`
    created: float

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block_tokens

    def record_bytes(self, layer: int) -> int:
        """One head's K (or V) of one block: a whole number of pages (`check_layout`)."""
        return self.block_tokens * self.layers[layer][1] * ITEM_BYTES[self.dtype]

    def region_offset(self, layer: int, kind: int, head: int) -> int:
        """File offset of the run holding (layer, K=0 | V=1, head) for every block, block 0 first."""
        earlier_bytes, _ = self._earlier[layer]
        return len(self.blocks) * (earlier_bytes + (kind * self.layers[layer][0] + head) * self.record_bytes(layer))

    def record_index(self, layer: int, kind: int, head: int, block: int) -> int:
        _, earlier_records = self._earlier[layer]
        return (earlier_records + kind * self.layers[layer][0] + head) * len(self.blocks) + block

    @cached_property
    def _earlier(self) -> list[tuple[int, int]]:
        """Per layer, the bytes of one block and the records of one block in the layers before it (computed once:
        every record's offset and checksum index starts from them)."""
        earlier, bytes_before, records_before = [], 0, 0
        for index, (heads, _) in enumerate(self.layers):
            earlier.append((bytes_before, records_before))
            bytes_before += 2 * heads * self.record_bytes(index)
            records_before += 2 * heads
        return earlier

    @property
    def block_span(self) -> int:
        """Bytes of one block over every layer, K and V."""
        last_bytes, _ = self._earlier[-1]
        return last_bytes + 2 * self.layers[-1][0] * self.record_bytes(len(self.layers) - 1)

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.block_span

    def check_layout(self) -> None:
        """Records must be whole pages, so that O_DIRECT reads land in place; true for head_dim >= 8 at 2 bytes."""
        for layer in range(len(self.layers)):
            if self.record_bytes(layer) % PAGE:
                raise StorageError(f"KV store: {self.block_tokens} tokens x head_dim {self.layers[layer][1]} x "
                                   f"{self.dtype} is not a whole number of 4 KiB pages")

    def to_bytes(self) -> bytes:
        return seal(asdict(self))

    @classmethod
    def parse(cls, data: bytes, where: Path) -> EntryMeta:
        try:
            return cls(**unseal(data))
        except BrokenSeal as error:
            raise CorruptEntry(f"{where}: {error}") from None
        except (ValueError, KeyError, TypeError) as error:
            raise CorruptEntry(f"{where}: unreadable ({error.__class__.__name__})") from None


def read_meta(directory: Path) -> EntryMeta:
    path = directory / META
    try:
        return EntryMeta.parse(path.read_bytes(), path)
    except FileNotFoundError:
        raise CorruptEntry(f"{path}: missing") from None
