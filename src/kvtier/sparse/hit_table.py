"""HKM's hit table: two bytes per token and layer recording how often and how recently it was selected.

The HillInfer paper (Fig. 8, BKP) observes that tokens selected as important keep
being selected (temporal locality) while per-step scores fluctuate. The table
keeps, per token position:

    hits  uint8  selections, halved every `decay_every` steps (frequency with aging)
    idle  uint8  steps since the last selection, saturating at 255 (recency)

That is 2 bytes per token, the paper's "2N bytes" table. The migration policy
(migration.py) reads both: a cold token is promoted only after repeated hits,
a hot token is demoted only after staying idle.
"""

from __future__ import annotations

import numpy as np

SATURATED = 255


class HitTable:
    """Hit counts and idle steps of one layer's tokens, indexed [sequence, position]."""

    def __init__(self, batch: int, capacity: int, decay_every: int = 64) -> None:
        self.hits = np.zeros((batch, capacity), dtype=np.uint8)
        self.idle = np.zeros((batch, capacity), dtype=np.uint8)
        self.decay_every = decay_every
        self.steps = 0

    @property
    def nbytes(self) -> int:
        return self.hits.nbytes + self.idle.nbytes

    def seed(self, positions: np.ndarray, hits: np.ndarray) -> None:
        """Start tokens at `positions` [batch, n] with `hits` [batch, n] (e.g. from prompt attention)."""
        np.put_along_axis(self.hits, positions, hits.astype(np.uint8), axis=1)
        np.put_along_axis(self.idle, positions, 0, axis=1)

    def record(self, selected: np.ndarray, tokens: int) -> None:
        """One decode step: `selected` [batch, k] positions were chosen among the first `tokens` positions."""
        idle = self.idle[:, :tokens]
        np.minimum(idle, SATURATED - 1, out=idle)
        idle += 1
        np.put_along_axis(self.idle, selected, 0, axis=1)
        hits = np.take_along_axis(self.hits, selected, axis=1)
        np.put_along_axis(self.hits, selected, np.minimum(hits, SATURATED - 1) + 1, axis=1)
        self.steps += 1
        if self.steps % self.decay_every == 0:
            self.hits >>= 1
