"""BKP: which cold tokens to promote to the hot pool and which hot tokens to demote, per step.

Promotions are swaps: a promoted cold token takes a demoted hot token's slot
and the victim takes its cold slot, so both pools keep their sizes (and every
sequence the same counts). At most `max_moves` swaps per layer, sequence and
step bound the disk writes a step can cost.

`HitPolicy` (HillInfer's dual metric): a cold token selected now is a
candidate only if the hit table shows repeated selections, as many as pay for
the swap's writes (promotion_price.py; at least `promote_hits`);
a hot token is a victim only if it has been idle for `idle_steps`; pairs are
made hottest candidate with coldest victim, and only while the candidate has
more hits than its victim (hysteresis).

`NaivePolicy` follows the instantaneous scores: every selected cold token is
a candidate, the hot tokens with the lowest score this step are the victims.
It exists to measure ping-pong against (bench/sparse), as in the paper's
Challenge 1.

`PingPongMeter` counts moves, and moves that undo a move of the same token
within `window` steps (a token demoted and promoted back, or vice versa).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.sparse.hot.hit_table import SATURATED, HitTable
from kvtier.sparse.hot.promotion_price import PromotionPrice

POLICIES = ("hit", "naive", "off")


@dataclass
class Swaps:
    """Pairs for one sequence: cold candidates (indices into the step's selected cold tokens) and hot victim slots."""

    promote: np.ndarray
    victims: np.ndarray

    def __len__(self) -> int:
        return len(self.promote)


NO_SWAPS = Swaps(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))


@dataclass(frozen=True)
class HitPolicy:
    max_moves: int = 8
    promote_hits: int = 2  # the floor: with a price, a candidate needs the hits that pay for its swap
    idle_steps: int = 16
    price: PromotionPrice | None = None

    def may_promote(self, table: HitTable, chosen: np.ndarray, first_cold: np.ndarray,
                    hot_positions: np.ndarray) -> np.ndarray:
        """Per sequence, whether `plan` can find a candidate and a victim: one check for the whole batch, since most
        steps promote nothing. `chosen` [batch, k]: the positions the step chose, each row's cold ones from column
        first_cold[row] on (a few: only their hits are read); `hot_positions` [batch, n]: the hot pool's."""
        if not self.max_moves:
            return np.zeros(len(chosen), dtype=bool)
        possible = table.any_hit(chosen, first_cold, self._needed_hits())
        if possible.any():
            possible &= table.any_idle(hot_positions, self.idle_steps)
        return possible

    def plan(self, table: HitTable, seq: int, cold_positions: np.ndarray, cold_scores: np.ndarray,
             hot_positions: np.ndarray, hot_scores: np.ndarray) -> Swaps:
        hits = table.hits[seq]
        candidate_hits = hits[cold_positions].astype(np.int64)
        candidates = np.flatnonzero(candidate_hits >= self._needed_hits())
        if not len(candidates) or not self.max_moves:  # most steps: skip ranking every hot token
            return NO_SWAPS
        candidates = candidates[np.argsort(-candidate_hits[candidates], kind="stable")]
        victim_hits = hits[hot_positions]
        idle = table.idle(seq, hot_positions)
        victims = np.flatnonzero(idle >= self.idle_steps)
        count = min(len(candidates), len(victims), self.max_moves)
        victims = victims[coldest(victim_hits[victims], idle[victims], count)]
        candidates = candidates[:count]
        worthwhile = candidate_hits[candidates] > victim_hits[victims]
        return Swaps(candidates[worthwhile], victims[worthwhile])

    def _needed_hits(self) -> int:
        return self.price.hits(self.promote_hits) if self.price is not None else self.promote_hits

    def overflow_victims(self, table: HitTable, hot_positions: np.ndarray, count: int) -> np.ndarray:
        """Hot slots [batch, count] to demote when the pool is over capacity: fewest hits, then longest idle."""
        return np.sort(coldest(table.hits_rows(hot_positions), table.idle_rows(hot_positions), count), axis=1)


def coldest(hits: np.ndarray, idle: np.ndarray, count: int) -> np.ndarray:
    """Indices of the `count` coldest tokens along the last axis, coldest first: fewest hits, then longest idle, then
    lowest index (a stable sort's order). One partial sort of a combined key, unique per token: a full sort of every
    hot token cost more than the rest of the plan."""
    tokens = hits.shape[-1]
    levels = SATURATED + 1  # hits and idle counts are uint8 (hit_table.py)
    key = (hits.astype(np.int64) * levels + (SATURATED - idle.astype(np.int64))) * tokens + np.arange(tokens)
    if 0 < count < tokens:
        key = np.take_along_axis(key, np.argpartition(key, count - 1, axis=-1)[..., :count], axis=-1)
    return np.sort(key, axis=-1)[..., :count] % tokens


@dataclass(frozen=True)
class NaivePolicy(HitPolicy):
    def may_promote(self, table: HitTable, chosen: np.ndarray, first_cold: np.ndarray,
                    hot_positions: np.ndarray) -> np.ndarray:
        # every chosen cold token is a candidate, every hot token a victim
        return (first_cold < chosen.shape[1]) & (self.max_moves > 0) & (hot_positions.shape[1] > 0)

    def plan(self, table: HitTable, seq: int, cold_positions: np.ndarray, cold_scores: np.ndarray,
             hot_positions: np.ndarray, hot_scores: np.ndarray) -> Swaps:
        candidates = np.argsort(-cold_scores, kind="stable")
        victims = np.argsort(hot_scores, kind="stable")
        count = min(len(candidates), len(victims), self.max_moves)
        candidates, victims = candidates[:count], victims[:count]
        worthwhile = cold_scores[candidates] > hot_scores[victims]
        return Swaps(candidates[worthwhile], victims[worthwhile])


def make_policy(name: str, max_moves: int, promote_hits: int, idle_steps: int,
                price: PromotionPrice | None = None) -> HitPolicy | None:
    """The policy `name`; the hit policy weighs each promotion against `price`, the naive one does not."""
    if name == "off":
        return None
    if name == "hit":
        return HitPolicy(max_moves, promote_hits, idle_steps, price)
    return NaivePolicy(max_moves, promote_hits, idle_steps)


class PingPongMeter:
    """Moves between the pools, and how many of them reverse a recent move of the same token."""

    def __init__(self, window: int = 32) -> None:
        self.window = window
        self.moves = 0
        self.ping_pongs = 0
        self._last: dict[tuple[int, int], tuple[int, int]] = {}  # (seq, position) -> (step, +1 promote / -1 demote)

    def record(self, step: int, seq: int, positions: np.ndarray, direction: int) -> None:
        for position in positions.tolist():
            key = (seq, position)
            last = self._last.get(key)
            if last is not None and last[1] == -direction and step - last[0] <= self.window:
                self.ping_pongs += 1
            self._last[key] = (step, direction)
            self.moves += 1
