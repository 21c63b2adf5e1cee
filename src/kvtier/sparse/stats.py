"""What each sparse decode step cost, broken down: scoring, fetch, attention, migration, the rest of the model.

Layers add their measurements to the current step; the cache opens a new step
when the first tiered layer sees a new token. `rest` (the model's own work:
projections, MLP, norms, sampling) is the step's wall time minus the parts,
filled in when the next step opens or on `finish()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

log = logging.getLogger(__name__)

PARTS = ("score_s", "fetch_s", "attention_s", "migrate_s")
# Upper bounds of the histogram of a decode step's estimated attention mass kept (`SparseStats.mass_histogram`)
MASS_BUCKETS = (0.5, 0.8, 0.9, 0.95, 0.99, 1.0)
# The phases of a layer's decode step (SparseLayer.attend: score, select, fetch, attend, migrate; in their order)
# and the part each is charged to.
PHASE_PARTS = {
    "look ahead": "score_s",  # the next layers' predicted queries sent to the scorer (lookahead)
    "take": "fetch_s",  # the wait for the candidates read ahead (lookahead)
    "settle": "migrate_s",  # the wait for last step's writes of this layer
    "hot scores": "score_s",  # the request to the scorer, the hot pool's q.k
    "window": "attention_s",  # the window's logits
    "cold scores": "score_s",  # the wait for the scorer's cold scores (layers not predicted)
    "choice": "score_s",  # the shortlist; the top-alpha over hot pool and shortlist by exact scores
    "submit": "fetch_s",  # the shortlist's reads queued
    "cold reads": "fetch_s",  # the wait for the shortlist's reads
    "hot segment": "attention_s",  # the chosen hot logits picked out (on CUDA also the values copied out)
    "softmax": "attention_s",
    "plan": "migrate_s",  # the hit table, the swaps planned
    "after": "migrate_s",  # the swaps, the window's retirements
}

_PHASES_OF = {part: tuple(phase for phase, of in PHASE_PARTS.items() if of == part) for part in PARTS}


@dataclass
class StepStats:
    """Sums over the tiered layers (and sequences, for counts) of one decode step."""

    step: int
    score_s: float = 0.0  # query -> merged top-k (hot scoring overlapped with the storage scorer)
    fetch_s: float = 0.0  # cold reads queued, then the wait for them that attention could not hide, + cold logits
    attention_s: float = 0.0
    migrate_s: float = 0.0  # hit table, swap planning, moving tokens between pools, waiting for last step's writes
    rest_s: float = 0.0
    background_write_s: float = 0.0  # the moves' disk writes, on the writer thread (not in total_s's parts)
    total_s: float = 0.0
    host_time_s: float = 0.0  # measured T_CPU: hot scoring + hot fetch
    storage_time_s: float = 0.0  # measured T_storage: scorer round trip + cold fetch
    predicted_host_s: float = 0.0  # APP's T_CPU for this step
    predicted_storage_s: float = 0.0  # APP's T_storage for this step
    selected_hot: int = 0
    selected_cold: int = 0
    pooled_hot: int = 0
    pooled_cold: int = 0
    cold_bytes_fetched: int = 0  # the K/V fetch's reads (whole read units, bridged gaps included)
    promotions: int = 0
    demotions: int = 0
    lookahead_layers: int = 0  # layers whose cold candidates were prefetched with a predicted query
    unpredicted_fetch_s: float = 0.0  # the part of fetch_s spent in the other layers (their reads on the critical path)
    mass_kept: float = 0.0  # estimated attention mass kept (mass.py), summed over layers and sequences
    mass_samples: int = 0  # the layers x sequences summed into mass_kept
    mass_min: float = 1.0  # the least of them
    guard_events: int = 0  # layers x sequences whose top-p ceiling the guard lifted

    def add_layer(self, clock: PhaseClock, read_ahead: bool, batch: int, hot_tokens: int, cold_tokens: int,
                  chosen_hot: int, chosen_cold: int, fetched_bytes: int) -> None:
        """Add one tiered layer's decode step: its phases (`clock`) to their parts, T_CPU and T_storage as measured,
        the hot and cold tokens pooled (per sequence, times `batch`) and chosen (over the batch), the bytes its cold
        reads took. `read_ahead`: the lookahead read its candidates, off the step's critical path."""
        clock.charge(self)
        phases = clock.seconds
        self.unpredicted_fetch_s += 0.0 if read_ahead else clock.part("fetch_s")
        self.host_time_s += phases["hot scores"]
        scorer_round_trip = phases["hot scores"] + phases["window"] + phases["cold scores"] if cold_tokens else 0.0
        self.storage_time_s += scorer_round_trip + phases["cold reads"]
        self.selected_hot += chosen_hot
        self.selected_cold += chosen_cold
        self.pooled_hot += hot_tokens * batch
        self.pooled_cold += cold_tokens * batch
        self.cold_bytes_fetched += fetched_bytes
        self.lookahead_layers += read_ahead


    def add_mass(self, kept: Sequence[float], guard_events: int) -> None:
        """Add one tiered layer's estimated mass kept per sequence and its guard events."""
        self.mass_kept += float(sum(kept))
        self.mass_samples += len(kept)
        self.mass_min = min(self.mass_min, *map(float, kept))
        self.guard_events += guard_events


class PhaseClock:
    """Times one layer's decode step as consecutive phases (PHASE_PARTS): each `lap` ends the running phase, so
    every moment from the clock's start to its last lap belongs to exactly one phase."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASE_PARTS, 0.0)
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def part(self, part: str) -> float:
        return sum(self.seconds[phase] for phase in _PHASES_OF[part])

    def charge(self, step: StepStats) -> None:
        """Add each phase to its part of `step`."""
        for part, phases in _PHASES_OF.items():
            setattr(step, part, getattr(step, part) + sum(self.seconds[phase] for phase in phases))


@dataclass
class SparseStats:
    steps: list[StepStats] = field(default_factory=list)
    _opened: float = 0.0
    # `budget_totals` of every step but the newest: the server asks for them at every token of a tiered sequence,
    # on the engine's thread, where a sum over every step would grow with the answer
    _earlier_budget: BudgetTotals = field(default_factory=lambda: BudgetTotals())

    def open_step(self) -> StepStats:
        self.finish()
        if self.steps:  # the newest step takes no more layers once the next one opens
            self._earlier_budget += _step_budget(self.steps[-1])
        self.steps.append(StepStats(step=len(self.steps)))
        self._opened = time.perf_counter()
        return self.steps[-1]

    @property
    def current(self) -> StepStats | None:
        return self.steps[-1] if self.steps else None

    def finish(self) -> None:
        """Close the open step: its wall time and the `rest`."""
        step = self.current
        if step is None or step.total_s:
            return
        step.total_s = time.perf_counter() - self._opened
        step.rest_s = max(0.0, step.total_s - sum(getattr(step, part) for part in PARTS))
        log.debug("sparse step %d: T_CPU predicted %.2f ms measured %.2f ms | T_storage predicted %.2f ms "
                  "measured %.2f ms | cold selected %d/%d", step.step, step.predicted_host_s * 1e3,
                  step.host_time_s * 1e3, step.predicted_storage_s * 1e3, step.storage_time_s * 1e3,
                  step.selected_cold, step.pooled_cold)

    def summary(self, skip: int = 1) -> dict[str, float]:
        """Mean per step of every field over the closed steps after the first `skip` (warm-up)."""
        self.finish()
        steps = [step for step in self.steps[skip:] if step.total_s] or [s for s in self.steps if s.total_s]
        if not steps:
            return {}
        fields = [name for name in asdict(steps[0]) if name != "step"]
        return {name: sum(getattr(step, name) for step in steps) / len(steps) for name in fields}

    def mass_histogram(self) -> dict[str, float]:
        """The decode steps' estimated mass kept (each step's mean over layers and sequences) as a histogram: per
        upper bound of MASS_BUCKETS the steps at or under it ("le_<bound>", cumulative), their count and sum."""
        means = [step.mass_kept / step.mass_samples for step in self.steps if step.mass_samples]
        return {**{f"le_{bound}": sum(mean <= bound for mean in means) for bound in MASS_BUCKETS},
                "count": len(means), "sum": sum(means)}

    def budget_report(self) -> dict[str, float | int | None]:
        """Over every decode step so far: the mean and the least estimated attention mass kept (over layers and
        sequences), the share of pooled tokens attended, the guard events (None where no step was recorded)."""
        return self.budget_totals().report()

    def budget_totals(self) -> BudgetTotals:
        """The sums behind `budget_report`, over every decode step so far that estimated its mass."""
        return self._earlier_budget + _step_budget(self.steps[-1]) if self.steps else self._earlier_budget


def _step_budget(step: StepStats) -> BudgetTotals:
    """One step's part of `SparseStats.budget_totals` (nothing where it estimated no mass)."""
    if not step.mass_samples:
        return BudgetTotals()
    return BudgetTotals(step.mass_kept, step.mass_samples, step.mass_min, step.selected_hot + step.selected_cold,
                        step.pooled_hot + step.pooled_cold, step.guard_events)


@dataclass(frozen=True)
class BudgetTotals:
    """Sums over decode steps (their layers and sequences) of what the attention budget kept; they add up over the
    steps of several caches (a request's choices), and `report` gives the means."""

    mass_kept: float = 0.0  # estimated attention mass kept, summed over `mass_samples` layer steps
    mass_samples: int = 0
    mass_min: float | None = None  # the least of them (None: no sample)
    attended: int = 0  # pooled tokens attended
    pooled: int = 0  # pooled tokens there were to attend
    guard_events: int = 0

    def __add__(self, other: BudgetTotals) -> BudgetTotals:
        least = [value for value in (self.mass_min, other.mass_min) if value is not None]
        return BudgetTotals(self.mass_kept + other.mass_kept, self.mass_samples + other.mass_samples,
                            min(least, default=None), self.attended + other.attended, self.pooled + other.pooled,
                            self.guard_events + other.guard_events)

    def report(self) -> dict[str, float | int | None]:
        """mass_kept_mean, mass_kept_min, attended_share (None where nothing was sampled) and guard_events."""
        return {"mass_kept_mean": self.mass_kept / self.mass_samples if self.mass_samples else None,
                "mass_kept_min": self.mass_min,
                "attended_share": self.attended / self.pooled if self.pooled else None,
                "guard_events": self.guard_events}
