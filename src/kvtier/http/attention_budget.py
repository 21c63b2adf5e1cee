"""What a tiered request's sparse selection kept, as its response reports it (`attention_budget`).

A tiered request's choices each decode through a sparse cache of their own; every decode step estimates the
attention mass its selection kept (kvtier.sparse.mass). The engine thread sends, before each token of a tiered
choice, that choice's running sums (`BudgetUpdate`); the request's figure adds up its choices' latest sums:
mean and least estimated mass kept over every layer step, the share of pooled tokens attended, guard events.
A choice ended here by a stop string counts the steps up to the token that ended it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.sparse.stats import BudgetTotals

FIELD = "attention_budget"  # the response's top-level field, beside `usage`


@dataclass(frozen=True)
class BudgetUpdate:
    """Choice `index`'s attention budget sums as of the token that follows it on the stream."""

    index: int
    totals: BudgetTotals


class RequestBudget:
    """Collects a request's `BudgetUpdate`s; `report()` is the response's `attention_budget` object."""

    def __init__(self) -> None:
        self._choices: dict[int, BudgetTotals] = {}

    def update(self, item: BudgetUpdate) -> None:
        self._choices[item.index] = item.totals

    def report(self) -> dict[str, float | int | None]:
        """mass_kept_mean, mass_kept_min, attended_share (null until a sparse decode step ran: a request whose every
        token came from its prefill) and guard_events, over every choice."""
        return sum(self._choices.values(), BudgetTotals()).report()
