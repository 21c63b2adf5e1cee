import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvtier.kernels import ops
from kvtier.sparse import planner
from kvtier.sparse.hot.hot_pool import HotPool
from kvtier.sparse.planner import Throughputs, balanced_beta, plan_split, predicted_times
from kvtier.sparse.threads import LAYER_STEP_THREADS, torch_threads

RATES = Throughputs(host_score=8e6, storage_score=1e6, host_fetch=4e6, storage_fetch=2e5)


def test_beta_is_equation_4_when_both_pools_select_alpha():
    alpha = 0.2
    fc, fs, bc, bs = RATES.host_score, RATES.storage_score, RATES.host_fetch, RATES.storage_fetch
    equation_4 = bc * fc * (bs + alpha * fs) / (bs * fs * (bc + alpha * fc))
    assert balanced_beta(RATES, alpha, alpha, pool=10_000) == pytest.approx(equation_4)


@pytest.mark.parametrize("round_trip", [0.0, 2e-3])
def test_balanced_beta_equalises_the_two_paths(round_trip):
    rates, pool, batch = replace(RATES, storage_round_trip=round_trip), 40_000, 2
    beta = balanced_beta(rates, 0.3, 0.05, pool, batch)
    hot = beta / (1 + beta) * pool
    host, storage = predicted_times(rates, hot, pool - hot, 0.3, 0.05, batch)
    assert host == pytest.approx(storage, rel=1e-6)


def test_a_scorer_round_trip_moves_tokens_hot_and_dominates_short_pools():
    slow_trip = replace(RATES, storage_round_trip=2e-3)
    assert balanced_beta(slow_trip, 0.2, 0.2, pool=40_000) > balanced_beta(RATES, 0.2, 0.2, pool=40_000)
    assert balanced_beta(slow_trip, 0.2, 0.2, pool=2_000) == float("inf")  # the round trip alone outweighs it
    assert balanced_beta(slow_trip, 0.2, 0.2, pool=2_000, batch=64) < float("inf")  # shared by a large batch


def test_skew_correction_moves_beta_toward_a_smaller_hot_pool():
    # Importance concentrated on few tokens: the hot pool holds most of the top-alpha set.
    importance = np.random.default_rng(0).pareto(1.0, (2, 5000))
    plan = plan_split(importance, 0.2, max_hot=10**9, rates=RATES, beta=None)
    assert plan.alpha_host > 0.2 > plan.alpha_storage
    assert plan.beta < balanced_beta(RATES, 0.2, 0.2, pool=5000)
    assert plan.hot_tokens == round(plan.beta / (1 + plan.beta) * 5000)


def test_host_budget_caps_the_hot_pool():
    plan = plan_split(np.ones((1, 1000)), 0.2, max_hot=100, rates=None, beta=3.0)
    assert plan.hot_tokens == 100 and plan.capped
    assert plan_split(np.ones((1, 1000)), 0.2, max_hot=10**6, rates=None, beta=3.0).hot_tokens == 750


def test_calibration_is_cached_per_machine_and_refreshable(tmp_path, monkeypatch):
    monkeypatch.setattr(planner, "cache_dir", lambda: tmp_path / "cache")
    calls = []
    monkeypatch.setattr(planner, "calibrate", lambda *args, **kwargs: calls.append(kwargs) or RATES)
    first = planner.load_or_calibrate(str(tmp_path), 2, 64, "float32", 8, "sum")
    again = planner.load_or_calibrate(str(tmp_path), 2, 64, "float32", 8, "sum")
    assert first == again == RATES and len(calls) == 1
    planner.load_or_calibrate(str(tmp_path), 2, 64, "float32", 8, "sum", refresh=True)
    assert len(calls) == 2
    planner.load_or_calibrate(str(tmp_path), 2, 64, "float32", 8, "sum", block_tokens=64)  # another scorer setting
    assert len(calls) == 3 and calls[-1]["block_tokens"] == 64
    stored = json.loads((tmp_path / "cache" / "sparse-calibration.json").read_text())
    assert list(stored.values()) == [vars(RATES)] * 2


def test_calibration_measures_on_the_layer_steps_threads_whatever_the_decodes(tmp_path, monkeypatch):
    """Host rates scale with torch's threads: they are measured on the threads a sparse layer's step runs on."""
    monkeypatch.setattr(planner, "cache_dir", lambda: tmp_path / "cache")
    calls = []
    monkeypatch.setattr(planner, "calibrate", lambda *args, **kwargs: calls.append(torch.get_num_threads()) or RATES)
    for count in (1, 2, 1):
        with torch_threads(count):
            planner.load_or_calibrate(str(tmp_path), 2, 64, "float32", 8, "sum")
            assert torch.get_num_threads() == count
    assert calls == [LAYER_STEP_THREADS]
    [key] = json.loads((tmp_path / "cache" / "sparse-calibration.json").read_text())
    assert f"|threads{LAYER_STEP_THREADS}|" in key


def test_calibrate_measures_positive_rates_with_the_real_paths(tmp_path):
    rates = planner.calibrate(str(tmp_path), 2, 32, torch.float32, 8, "sum", tokens=2048)
    assert min(vars(rates).values()) > 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_timed_host_fetch_reads_the_picked_values_as_the_step_does(dtype):
    """In place by the weighted sum where the kernel takes the pool (float32 on AVX2; here the weights are 1/n, so the
    mean of the picked rows), else the picked rows copied out, as the decode step does."""
    values = torch.randn(1, 2, 40, 16).to(dtype)
    hot = HotPool(1, 2, 16, dtype)
    hot.append(values, values, np.arange(40)[None])
    picks = np.array([1, 5, 6, 30])
    fetched = planner._gather_values(hot, picks)()
    picked = values[0][:, torch.from_numpy(picks)]
    if dtype == torch.float32 and ops.VECTORIZED:
        torch.testing.assert_close(fetched[0, :, 0], picked.mean(dim=1))
    else:
        torch.testing.assert_close(fetched, picked)
