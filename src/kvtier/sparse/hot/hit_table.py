"""HKM's hit table: two bytes per token and layer recording how often and how recently it was selected.

The HillInfer paper (Fig. 8, BKP) observes that tokens selected as important keep
being selected (temporal locality) while per-step scores fluctuate. The table
keeps, per token position:

    hits   uint8  selections, halved every `decay_every` steps (frequency with aging)
    stamp  uint8  the step (mod 256) of the last selection (recency)

That is 2 bytes per token, the paper's "2N bytes" table. A step writes only the
k tokens it selected: the idle steps of a token are derived from its stamp
(`idle`) rather than counted up for every token every step, which cost O(context)
per layer and step. Every `RESTAMP_EVERY` steps the tokens idle longer than
255 - RESTAMP_EVERY are restamped to that age, so the derived idle count is
exact up to it and saturates between it and 255 without ever wrapping.
The migration policy (migration.py) reads both: a cold token is promoted only
after repeated hits, a hot token is demoted only after staying idle.
"""

from __future__ import annotations

import numpy as np

from kvtier.kernels import ops

SATURATED = 255
RESTAMP_EVERY = 64
OLDEST = SATURATED - RESTAMP_EVERY  # idle counts above this one are clamped to it at the next restamp


class HitTable:
    """Hit counts and selection stamps of one layer's tokens, indexed [sequence, position]."""

    def __init__(self, batch: int, capacity: int, decay_every: int = 64) -> None:
        self.hits = np.zeros((batch, capacity), dtype=np.uint8)
        self.stamp = np.zeros((batch, capacity), dtype=np.uint8)
        self.decay_every = decay_every
        self.steps = 0
        self._rows = np.arange(batch)[:, None]

    @property
    def nbytes(self) -> int:
        return self.hits.nbytes + self.stamp.nbytes

    def idle(self, rows: int | np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Steps since the tokens at [rows, positions] were last selected or seeded (uint8)."""
        return self._since(self.stamp[rows, positions])

    def any_idle(self, positions: np.ndarray, steps: int) -> np.ndarray:
        """Per row of positions [batch, n], whether one of its tokens has been idle `steps` (1-255) steps or more:
        a scan that stops at the first (hit_table.c)."""
        return ops.any_idle(self.stamp, positions=positions, now=self.steps % 256, steps=steps)

    def any_hit(self, positions: np.ndarray, first: np.ndarray, hits: int) -> np.ndarray:
        """Per row of positions [batch, n], whether one of its tokens from column first[row] on has `hits` hits or
        more: a scan that stops at the first (hit_table.c)."""
        return ops.any_hit(self.hits, positions=positions, first=np.ascontiguousarray(first, dtype=np.int64),
                           needed=min(hits, 256))

    def idle_rows(self, positions: np.ndarray) -> np.ndarray:
        """`idle` of positions [batch, n], one row per sequence."""
        return self._since(self.stamp.reshape(-1)[self._flat(positions)])

    def _since(self, stamps: np.ndarray) -> np.ndarray:
        """Steps since `stamps` (uint8, wrapping as the stamps do)."""
        return np.uint8(self.steps % 256) - stamps

    def hits_rows(self, positions: np.ndarray) -> np.ndarray:
        """`hits` of positions [batch, n], one row per sequence."""
        return self.hits.reshape(-1)[self._flat(positions)]

    def _flat(self, positions: np.ndarray) -> np.ndarray:
        """Indices into the flattened table of positions [batch, n]: 1-D indexing costs a third of the 2-D's."""
        return positions + self._rows * self.hits.shape[1]

    def seed(self, positions: np.ndarray, hits: np.ndarray) -> None:
        """Start tokens at `positions` [batch, n] with `hits` [batch, n] (e.g. from prompt attention), idle 0."""
        self.hits[self._rows, positions] = hits.astype(np.uint8)
        self.stamp[self._rows, positions] = self.steps % 256

    def restore(self, hits: np.ndarray, idle: np.ndarray) -> None:
        """Sequence 0's first len(hits) positions take these hit counts and idle steps (a stored image's table)."""
        count = len(hits)
        self.hits[0, :count] = hits
        self.stamp[0, :count] = (self.steps - np.minimum(idle, OLDEST).astype(np.int64)) % 256

    def record(self, selected: np.ndarray) -> None:
        """One decode step: the tokens at `selected` [batch, k] positions (distinct within a row) were chosen."""
        ops.record_hits(self.hits, self.stamp, positions=selected, now=(self.steps + 1) % 256)
        self.steps += 1
        if self.steps % self.decay_every == 0:
            self.hits >>= 1
        if self.steps % RESTAMP_EVERY == 0:
            self._restamp()

    def _restamp(self) -> None:
        every = slice(None)
        old = self.idle(every, every) > OLDEST
        self.stamp[old] = (self.steps - OLDEST) % 256
