"""Which chunk lies in which slot: the in-memory index, rebuilt on restart by replaying the journal."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.integrations.vllm.journal import PUT, RECLAIM, Record, head, put


@dataclass(frozen=True)
class Entry:
    slot: int
    crc: int  # crc32c of the chunk's bytes, checked on every read
    seq: int  # allocation order: the journal's clock


@dataclass
class Replayed:
    """What a journal says about the flash file: the index, the slots ever written, the log head."""

    index: ChunkIndex
    written: set[int]
    head: int
    next_seq: int


class ChunkIndex:
    """key -> Entry and slot -> key; a slot holds at most one chunk, a chunk lies in at most one slot."""

    def __init__(self) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._keys: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def add(self, key: bytes, entry: Entry) -> None:
        """`key` now lies in `entry.slot`; whatever either held before is forgotten."""
        self.remove(key)
        self.drop_slots([entry.slot])
        self._entries[key], self._keys[entry.slot] = entry, key

    def remove(self, key: bytes) -> Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            del self._keys[entry.slot]
        return entry

    def drop_slots(self, slots: Iterable[int]) -> list[bytes]:
        """Forget the chunks in `slots`; return their keys."""
        dropped = [self._keys.pop(slot) for slot in slots if slot in self._keys]
        for key in dropped:
            del self._entries[key]
        return dropped

    def slots(self) -> list[int]:
        return list(self._keys)

    def records(self, at: int, seq: int) -> list[Record]:
        """The journal that says exactly this: one PUT per entry in allocation order, then the head `at` (seq `seq`)."""
        ordered = sorted(self._entries.items(), key=lambda item: item[1].seq)
        return [put(entry.seq, entry.slot, entry.crc, key) for key, entry in ordered] + [head(seq, at)]

    @classmethod
    def replay(cls, records: Iterable[Record], num_slots: int) -> Replayed:
        """Apply `records` in journal order; the head follows the PUT or HEAD record allocated last."""
        index, written = cls(), set()
        at, head_seq, last_seq = 0, -1, -1
        for record in records:
            last_seq = max(last_seq, record.seq)
            if record.kind == RECLAIM:
                index.drop_slots(range(record.slot, record.slot + record.count))
                continue
            if record.kind == PUT:
                index.add(record.key, Entry(record.slot, record.data_crc, record.seq))
                written.add(record.slot)
            if record.seq > head_seq:
                at, head_seq = (record.slot + 1) % num_slots if record.kind == PUT else record.slot, record.seq
        return Replayed(index, written, at, last_seq + 1)
