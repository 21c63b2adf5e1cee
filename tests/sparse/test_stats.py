"""The step breakdown: a layer's phases each charged to one part; the rest is the step's wall time minus the parts."""

import itertools

import pytest

from kvtier.sparse import stats
from kvtier.sparse.stats import PHASE_PARTS, PARTS, BudgetTotals, PhaseClock, SparseStats, StepStats


@pytest.fixture
def ticks(monkeypatch):
    """perf_counter reads 0, 1, 3, 6, 10, ... seconds: the n-th interval lasts n seconds."""
    times = itertools.accumulate(itertools.count())
    monkeypatch.setattr(stats.time, "perf_counter", lambda: float(next(times)))


def test_each_lap_ends_the_running_phase_and_a_phase_may_recur(ticks):
    clock = PhaseClock()  # 0
    clock.lap("take")  # 1: 1 s
    clock.lap("hot scores")  # 3: 2 s
    clock.lap("take")  # 6: 3 s more
    assert clock.seconds["take"] == 4.0 and clock.seconds["hot scores"] == 2.0
    assert sum(clock.seconds.values()) == 6.0  # every moment since the start, once


def test_charging_adds_each_phase_to_its_part(ticks):
    clock = PhaseClock()
    for phase in PHASE_PARTS:  # in the step's order, the n-th lasting n seconds
        clock.lap(phase)
    step = StepStats(step=0, fetch_s=0.5)
    clock.charge(step)
    expected = {part: 0.0 for part in PARTS}
    for seconds, phase in enumerate(PHASE_PARTS, start=1):
        expected[PHASE_PARTS[phase]] += seconds
    expected["fetch_s"] += 0.5  # added to what the step held
    assert {part: getattr(step, part) for part in PARTS} == expected
    assert set(PHASE_PARTS.values()) == set(PARTS)  # every part has a phase


@pytest.mark.parametrize("read_ahead", [False, True])
def test_a_layer_adds_its_phases_measured_times_and_tokens(ticks, read_ahead):
    clock = PhaseClock()
    for phase in PHASE_PARTS:  # in the step's order, the n-th lasting n seconds
        clock.lap(phase)
    seconds = clock.seconds
    step = StepStats(step=0)
    step.add_layer(clock, read_ahead, batch=2, hot_tokens=10, cold_tokens=30, chosen_hot=3, chosen_cold=5,
                   fetched_bytes=4096)
    assert step.fetch_s == clock.part("fetch_s") > 0
    assert step.unpredicted_fetch_s == (0.0 if read_ahead else step.fetch_s)
    assert step.host_time_s == seconds["hot scores"]  # T_CPU: the hot pool scored
    # T_storage: the scorer's round trip (while the host scored and built the window's logits) and the cold reads
    assert step.storage_time_s == seconds["hot scores"] + seconds["window"] + seconds["cold scores"] + \
        seconds["cold reads"]
    assert (step.pooled_hot, step.pooled_cold, step.selected_hot, step.selected_cold) == (20, 60, 3, 5)
    assert (step.cold_bytes_fetched, step.lookahead_layers) == (4096, int(read_ahead))


def test_a_layer_without_cold_tokens_has_no_scorer_round_trip(ticks):
    clock = PhaseClock()
    for phase in PHASE_PARTS:
        clock.lap(phase)
    step = StepStats(step=0)
    step.add_layer(clock, False, batch=1, hot_tokens=10, cold_tokens=0, chosen_hot=2, chosen_cold=0, fetched_bytes=0)
    assert step.storage_time_s == clock.seconds["cold reads"]


def test_the_rest_is_the_wall_time_minus_the_parts(ticks):
    recorded = SparseStats()
    step = recorded.open_step()  # opened at 0
    step.score_s, step.attention_s = 0.25, 0.5
    recorded.finish()  # closed at 1
    assert step.total_s == 1.0 and step.rest_s == 0.25


def test_the_budget_report_is_over_the_steps_that_estimated_their_mass_and_their_sums_add_up():
    record = SparseStats()
    assert record.budget_report() == {"mass_kept_mean": None, "mass_kept_min": None, "attended_share": None,
                                      "guard_events": 0}
    record.open_step()  # the prompt's: no mass estimated, its tokens are not a decode step's
    record.current.pooled_hot = 1000
    for kept, guards, chosen in (([0.9, 0.8], 1, 30), ([0.95, 0.99], 0, 10)):
        step = record.open_step()
        step.add_mass(kept, guards)
        step.selected_hot, step.pooled_hot = chosen, 100
    totals = record.budget_totals()
    assert totals == BudgetTotals(pytest.approx(3.64), 4, 0.8, 40, 200, 1)
    assert record.budget_report() == {"mass_kept_mean": pytest.approx(0.91), "mass_kept_min": 0.8,
                                      "attended_share": 0.2, "guard_events": 1}
    assert (totals + BudgetTotals()).report() == totals.report()  # nothing sampled adds nothing, nor its min
    assert (totals + BudgetTotals(0.5, 1, 0.5, 1, 10, 2)).report()["mass_kept_min"] == 0.5
    record.current.add_mass([0.5], 0)  # the open step's next layer counts at once
    assert record.budget_totals().mass_samples == 5 and record.budget_totals().mass_min == 0.5
    record.open_step()  # and stays counted once the step is closed
    assert record.budget_totals() == BudgetTotals(pytest.approx(4.14), 5, 0.5, 40, 200, 1)
