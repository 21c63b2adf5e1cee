import numpy as np
import pytest

from kvtier.sparse.hot.hit_table import SATURATED, HitTable
from kvtier.sparse.hot.migration import HitPolicy
from kvtier.sparse.hot.promotion_price import PromotionPrice


def _fed(write_s_per_swap, fixed_s, per_token_s, counts=(10, 40, 80, 20, 60) * 20):
    price = PromotionPrice()
    for count in counts:
        price.observe_fetch(fixed_s + per_token_s * count, count)
    price.observe_writes(write_s_per_swap * 4, 4)
    return price


def test_floor_until_both_costs_are_measured():
    price = PromotionPrice()
    assert price.hits(2) == 2
    price.observe_writes(0.004, 4)
    assert price.hits(2) == 2  # no fetch measured yet
    price.observe_fetch(0.001, 10)
    assert price.hits(2) == 2  # one layer gives no slope


def test_the_marginal_fetch_cost_is_the_slope_not_the_average():
    price = _fed(write_s_per_swap=1e-3, fixed_s=1e-3, per_token_s=5e-6)
    assert price.fetch_s_per_token == pytest.approx(5e-6, rel=1e-6)  # the average would be ~30 us
    assert price.hits(2) == 200  # 1 ms of writes / 5 us per fetched token


def test_cheap_writes_keep_the_floor_and_dear_ones_saturate():
    assert _fed(write_s_per_swap=5e-6, fixed_s=1e-3, per_token_s=5e-6).hits(2) == 2
    assert _fed(write_s_per_swap=1.0, fixed_s=1e-3, per_token_s=5e-6).hits(2) == SATURATED
    assert _fed(write_s_per_swap=1e-3, fixed_s=1e-3, per_token_s=0.0).hits(2) == SATURATED


def test_the_hit_policy_promotes_only_what_pays():
    table = HitTable(batch=1, capacity=4)
    table.hits[0] = [30, 0, 0, 0]
    table.steps, table.stamp[0] = 100, [100, 50, 50, 50]  # positions 1-3 idle 50 steps
    plan = lambda price: HitPolicy(price=price).plan(table, 0, np.array([0]), np.zeros(1), np.array([1, 2, 3]),
                                                     np.zeros(3))
    assert len(plan(_fed(write_s_per_swap=1e-4, fixed_s=1e-3, per_token_s=5e-6))) == 1  # 20 hits pay
    assert len(plan(_fed(write_s_per_swap=1e-3, fixed_s=1e-3, per_token_s=5e-6))) == 0  # 200 needed
