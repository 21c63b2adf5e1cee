"""What a promotion must be expected to save before the hit policy makes it: measured, not assumed.

A swap rewrites the victim's cold slot (a read-modify-write of its pages in the
K|V and the sketch file) so that later steps need not fetch the promoted token
from the disk. A token's hit count estimates how often it will be selected (its
selections over the last `decay_every` steps or so), so a promotion pays when

    hits x (marginal fetch time of one cold token) > write time per swap.

Both are measured while decoding: the write time from the background writer's
swaps, the marginal fetch time as the slope of a layer's cold-fetch time over
its token count (a streaming least-squares fit over layers and steps: most of
a fetch's time is per layer, whatever its count, and a promotion saves only the
per-token part). The price in hits, never below the policy's `promote_hits`,
is what a cold token needs to be promoted. Where writes are cheap against
reads it stays near the floor; where synchronous O_DIRECT writes cost hundreds
of fetched tokens (the development VM) it saturates and swaps stop.
"""

from __future__ import annotations

import math

from kvtier.sparse.hot.hit_table import SATURATED

SMOOTHING = 0.05  # weight of a new observation in the running averages


class PromotionPrice:
    """Measured swap write cost over the marginal cold-fetch cost per token, as a minimum hit count."""

    def __init__(self) -> None:
        self.write_s_per_swap: float | None = None
        self._fetch = _RunningFit()

    @property
    def fetch_s_per_token(self) -> float | None:
        return self._fetch.slope()

    def observe_writes(self, seconds: float, swaps: int) -> None:
        """The writer spent `seconds` on `swaps` swaps' cold writes (called on the writer thread)."""
        if swaps:
            self.write_s_per_swap = seconds / swaps if self.write_s_per_swap is None else \
                (1 - SMOOTHING) * self.write_s_per_swap + SMOOTHING * seconds / swaps

    def observe_fetch(self, seconds: float, tokens: int) -> None:
        """A layer's cold fetch took `seconds` of the step for `tokens` tokens."""
        self._fetch.add(tokens, seconds)

    def hits(self, floor: int) -> int:
        """Hits a cold token needs for its promotion to pay (at least `floor`; `floor` until both costs are known)."""
        per_token = self.fetch_s_per_token
        if self.write_s_per_swap is None or per_token is None:
            return floor
        if per_token <= 0:  # a token more costs nothing measurable: no promotion pays
            return SATURATED
        return max(floor, min(SATURATED, math.ceil(self.write_s_per_swap / per_token)))


class _RunningFit:
    """Exponentially weighted least-squares slope of y over x."""

    def __init__(self) -> None:
        self.x = self.y = self.xx = self.xy = 0.0
        self.seen = 0

    def add(self, x: float, y: float) -> None:
        keep = 1 - SMOOTHING if self.seen else 0.0
        self.x, self.y = keep * self.x + (1 - keep) * x, keep * self.y + (1 - keep) * y
        self.xx, self.xy = keep * self.xx + (1 - keep) * x * x, keep * self.xy + (1 - keep) * x * y
        self.seen += 1

    def slope(self) -> float | None:
        spread = self.xx - self.x * self.x
        if self.seen < 2 or spread <= 1e-9 * max(1.0, self.xx):
            return None
        return (self.xy - self.x * self.y) / spread
