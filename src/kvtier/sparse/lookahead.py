"""Lookahead: a layer's cold candidates are scored and read before it attends, while the layers before it compute.

A layer asks for its candidates with the query it attended with at the step
before (what a layer chose at one step it mostly chooses at the next: the hit
table's observation). As layer l starts attending (before it takes its own
candidates), it sends layer l+1's query of the step before to the storage
scorer, which scores layer l+1's cold pool with it once it is done with layer
l's request (or while layer l's candidate reads are on the disk), then reads
layer l+1's top candidates' full-precision K/V and checks them
(candidate_reads.py), all while layer l computes. By the time layer l+1
attends they are usually waiting in shared memory: neither the scoring nor
the cold reads sit on the host's critical path, nor on its core.

A layer whose candidates came late (its step waited for them) is asked for
one layer earlier from then on, up to three layers ahead (SparseLayer's
`ahead`): the scorer's and the disk's time per layer is uneven, a few layers
read far more candidates than the rest, and an earlier request spreads their
reads over the layers before them.

The query of the step before only chooses *candidates*, per sequence `margin`
x the cold tokens it chose in the layer last step (selection.candidate_counts):
the layer scores them with its own query on their full-precision keys, and
its top-alpha over hot pool and candidates is exact for every token it
considers, as a layer's over the shortlist it draws up itself (selection.py). A cold
token the step before's query ranks below the candidates is missed;
docs/decisions.md has the recall (as good as predicting the query from the
layer before's input, which this replaced).

Only layers that directly follow a tiered layer are asked for a layer ahead
(Gemma 3's full layers are five sliding layers apart), not layers whose cold
pool is under `min_cold` tokens per sequence (there the choice among
candidates costs about what it hides), and not the first `skip` tiered
layers: those are asked for a step ahead instead. As the last tiered layer
starts attending, the scorer is sent their queries of the step now ending,
and it reads their candidates while the model finishes the step and begins
the next. A step that begins with anything else in flight (the one before
ended midway) drops it all (`open_step`).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from kvtier.sparse.cold_pool import Fetched
from kvtier.sparse.selection import MIN_CANDIDATES, candidate_counts


class Lookahead:
    """The layers ahead: their requests at the scorer, which scores them and reads candidates in order.
    Layer l + 1's request goes out as layer l starts attending, while the scorer may still read layer l's."""

    def __init__(self, margin: float, skip: int, min_cold: int, scorer, cold) -> None:
        self.margin, self.skip, self.min_cold = margin, skip, min_cold
        self.scorer, self.cold = scorer, cold
        self._tiers: deque[int] = deque()  # the layers ahead, oldest first, while the scorer works on them
        self._for_next_step: list[int] = []  # those asked for at the end of a step, for the next

    @property
    def in_flight(self) -> tuple[int, ...]:
        """The tiers whose candidates are being scored or read, oldest first."""
        return tuple(self._tiers)

    def wants(self, next_tier: int, layer_idx: int, next_layer_idx: int) -> bool:
        """`is_predicted` under this lookahead's skip."""
        return is_predicted(next_tier, layer_idx, next_layer_idx, self.skip)

    def worth(self, cold_tokens: int) -> bool:
        """Whether a layer with `cold_tokens` cold tokens per sequence is large enough to ask for ahead."""
        return cold_tokens >= self.min_cold

    def candidate_counts(self, cold_picked: np.ndarray, cold_tokens: int, least: int) -> np.ndarray:
        """Candidates per sequence: `margin` x its last cold picks, at least MIN_CANDIDATES and `least`."""
        return candidate_counts(self.margin, cold_picked, cold_tokens, least)

    def start(self, tier: int, query: np.ndarray, cold_tokens: int, counts: np.ndarray,
              next_step: bool = False) -> None:
        """Ask the scorer for tier `tier`'s best `counts` candidates under `query` (the layer's of the step before),
        after the requests it has in hand; the layer's writes must be settled. `next_step`: asked for the next decode
        step."""
        self.scorer.request(tier, query, cold_tokens, counts)
        self._tiers.append(tier)
        if next_step:
            self._for_next_step.append(tier)

    def open_step(self) -> None:
        """A decode step begins: keep what the step before asked for it if nothing else is in flight (else the step
        before failed midway), drop the rest."""
        if list(self._tiers) != self._for_next_step:
            self.drain()
        self._for_next_step = []

    def take(self, tier: int) -> Fetched | None:
        """The candidates read ahead for `tier` (waiting for them if need be), or None when none were started for it."""
        if not self._tiers or self._tiers[0] != tier:
            self.drain()
            return None
        self._tiers.popleft()
        slots, records, nbytes = self.scorer.candidates()
        return self.cold.fetched(slots, records, int(nbytes.sum()))

    def drain(self) -> None:
        """Finish what is in flight and drop it (a step that ended midway): the scorer is free."""
        while self._tiers:
            self._tiers.popleft()
            self.scorer.candidates()
        self._for_next_step = []

    def close(self) -> None:
        self.drain()  # the scorer must not still read when the pool closes


def candidate_capacity(alpha: float, margin: float, max_tokens: int) -> int:
    """The most candidates `Lookahead.candidate_counts` asks for per sequence in a pool of up to `max_tokens`
    tokens: a layer picks at most ceil(alpha x pooled) cold tokens, and needs at most that many candidates."""
    return min(max_tokens, max(MIN_CANDIDATES, math.ceil(margin * math.ceil(alpha * max_tokens))))


def is_predicted(next_tier: int, layer_idx: int, next_layer_idx: int, skip: int) -> bool:
    """Whether tier `next_tier` (model layer `next_layer_idx`) is asked for by layer `layer_idx`, a layer ahead."""
    return next_layer_idx == layer_idx + 1 and next_tier >= skip
