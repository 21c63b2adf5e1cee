"""Which chunk lies in which slot: the in-memory index, rebuilt on restart by replaying the journal.

Keys map to slots in a dict; each slot's crc32c and allocation sequence number sit in numpy arrays,
so a replay of 100K records is a few vectorized passes and two dict builds, not 100K objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvtier.integrations.vllm.journal import HEAD, PUT, RECLAIM, Record, Records, head, put


@dataclass(frozen=True)
class Entry:
    slot: int
    crc: int  # crc32c of the chunk's bytes, checked on every read
    seq: int  # allocation order: the journal's clock


@dataclass
class Replayed:
    """What a journal says about the flash file: the index, the slots ever written, the log head."""

    index: ChunkIndex
    written: list[int]
    head: int
    next_seq: int


class ChunkIndex:
    """key -> slot and slot -> key; a slot holds at most one chunk, a chunk lies in at most one slot."""

    def __init__(self, num_slots: int) -> None:
        self._slots: dict[bytes, int] = {}
        self._keys: dict[int, bytes] = {}
        self._crcs = np.zeros(num_slots, dtype=np.uint32)
        self._seqs = np.zeros(num_slots, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def get(self, key: bytes) -> Entry | None:
        slot = self._slots.get(key)
        return None if slot is None else Entry(slot, int(self._crcs[slot]), int(self._seqs[slot]))

    def add(self, key: bytes, entry: Entry) -> None:
        """`key` now lies in `entry.slot`; whatever either held before is forgotten."""
        self.remove(key)
        self.drop_slots([entry.slot])
        self._slots[key], self._keys[entry.slot] = entry.slot, key
        self._crcs[entry.slot], self._seqs[entry.slot] = entry.crc, entry.seq

    def remove(self, key: bytes) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            del self._keys[slot]

    def drop_slots(self, slots: Iterable[int]) -> list[bytes]:
        """Forget the chunks in `slots`; return their keys."""
        dropped = [self._keys.pop(slot) for slot in slots if slot in self._keys]
        for key in dropped:
            del self._slots[key]
        return dropped

    def slots(self) -> list[int]:
        return list(self._keys)

    def records(self, at: int, seq: int) -> list[Record]:
        """The journal that says exactly this: one PUT per entry in allocation order, then the head `at` (seq `seq`)."""
        ordered = sorted(self._keys, key=lambda slot: self._seqs[slot])
        return [put(int(self._seqs[slot]), slot, int(self._crcs[slot]), self._keys[slot]) for slot in ordered] + [
            head(seq, at)]

    @classmethod
    def replay(cls, records: Records, num_slots: int) -> Replayed:
        """What applying `records` in journal order gives; the head follows the PUT or HEAD allocated last."""
        index, array = cls(num_slots), records.array
        if not len(records):
            return Replayed(index, [], 0, 0)
        kinds, slots, seqs = array["kind"], array["slot"].astype(np.int64), array["seq"].astype(np.int64)
        positions = np.arange(len(array))
        puts = kinds == PUT
        last_put = np.full(num_slots, -1, dtype=np.int64)
        np.maximum.at(last_put, slots[puts], positions[puts])
        last_reclaim = np.full(num_slots, -1, dtype=np.int64)
        for position in np.flatnonzero(kinds == RECLAIM).tolist():  # one per reclaimed segment: few
            last_reclaim[slots[position] : slots[position] + array["count"][position]] = position
        surviving = np.sort(last_put[last_put > last_reclaim])
        index._slots = dict(zip([records.keys[p] for p in surviving.tolist()], slots[surviving].tolist()))
        index._keys = {slot: key for key, slot in index._slots.items()}  # a key stored twice keeps its last slot
        live = np.fromiter(index._keys, dtype=np.int64, count=len(index._keys))
        index._crcs[live] = array["data_crc"][last_put[live]]
        index._seqs[live] = seqs[last_put[live]]
        movers = np.flatnonzero(puts | (kinds == HEAD))
        last = int(movers[np.argmax(seqs[movers])]) if len(movers) else -1
        at = 0 if last < 0 else int(slots[last] + 1) % num_slots if kinds[last] == PUT else int(slots[last])
        return Replayed(index, np.unique(slots[puts]).tolist(), at, int(seqs.max()) + 1)
