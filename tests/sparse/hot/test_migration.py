import numpy as np

from kvtier.sparse.hot.hit_table import HitTable
from kvtier.sparse.hot.migration import HitPolicy, NaivePolicy, PingPongMeter, coldest, make_policy


def _table(hits, idle):
    table = HitTable(batch=1, capacity=len(hits))
    _set_idle(table, [idle])
    table.hits[0] = hits
    return table


def _set_idle(table, idle):
    """Stamps that make table.idle equal `idle` [batch, capacity] (a table that has run 100 steps)."""
    table.steps = 100
    table.stamp[:] = (table.steps - np.array(idle)) % 256


def test_hit_policy_promotes_repeat_hits_over_idle_victims():
    #            positions: 0  1  2  3  4  5
    table = _table(hits=[3, 1, 5, 0, 0, 2], idle=[0, 0, 0, 20, 30, 40])
    cold_positions = np.array([0, 1, 2])  # selected this step
    hot_positions = np.array([3, 4, 5])
    swaps = HitPolicy(max_moves=8, promote_hits=2, idle_steps=16).plan(
        table, 0, cold_positions, np.zeros(3), hot_positions, np.zeros(3))
    # candidates: positions 2 (5 hits) then 0 (3 hits); victims: 4 (0 hits, idle 30), then 3 (0 hits, idle 20)
    assert swaps.promote.tolist() == [2, 0] and swaps.victims.tolist() == [1, 0]


def test_hit_policy_needs_idle_victims_and_more_hits_than_them():
    table = _table(hits=[3, 4, 4], idle=[0, 5, 30])
    policy = HitPolicy(max_moves=8, promote_hits=2, idle_steps=16)
    swaps = policy.plan(table, 0, np.array([0]), np.zeros(1), np.array([1, 2]), np.zeros(2))
    assert len(swaps) == 0  # position 1 is not idle; position 2 is idle but has more hits


def test_moves_are_bounded():
    table = _table(hits=[9] * 5 + [0] * 5, idle=[0] * 5 + [99] * 5)
    swaps = HitPolicy(max_moves=2).plan(table, 0, np.arange(5), np.zeros(5), np.arange(5, 10), np.zeros(5))
    assert len(swaps) == 2


def test_naive_policy_follows_this_steps_scores():
    table = _table(hits=[0] * 4, idle=[0] * 4)
    swaps = NaivePolicy(max_moves=8).plan(table, 0, np.array([0, 1]), np.array([5.0, 1.0]), np.array([2, 3]),
                                          np.array([0.5, 3.0]))
    assert swaps.promote.tolist() == [0] and swaps.victims.tolist() == [0]  # 1.0 < 3.0: the second pair is not worth it


def test_may_promote_says_which_sequences_have_a_candidate_and_a_victim():
    table = HitTable(batch=4, capacity=8)
    table.hits[:] = [[5, 0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 4, 0, 0], [9] * 8, [0, 0, 0, 0, 1, 4, 0, 0]]
    _set_idle(table, [[0] * 6 + [20] * 2] * 3 + [[0] * 8])  # row 3: every token selected lately, no victim
    chosen = np.array([[0, 4], [4, 5], [0, 1], [4, 5]])  # per row the hot positions first
    hot_counts = np.array([1, 1, 2, 1])  # row 0: its many hits are hot; row 1: cold 5 has 4; row 2: no cold choice
    hot = np.array([[0, 6, 7], [4, 6, 7], [0, 1, 6], [4, 6, 7]])
    assert HitPolicy(promote_hits=2).may_promote(table, chosen, hot_counts, hot).tolist() == [False, True, False, False]
    assert HitPolicy(promote_hits=5).may_promote(table, chosen, hot_counts, hot).tolist() == [False] * 4
    assert HitPolicy(max_moves=0, promote_hits=2).may_promote(table, chosen, hot_counts, hot).tolist() == [False] * 4
    assert NaivePolicy().may_promote(table, chosen, hot_counts, hot).tolist() == [True, True, False, True]


def test_may_promote_rules_out_only_sequences_plan_would_not_swap():
    rng = np.random.default_rng(0)
    for _ in range(50):
        table = HitTable(batch=4, capacity=64)
        table.hits[:] = rng.integers(0, 6, size=(4, 64))
        _set_idle(table, rng.integers(0, 17, size=(4, 64)))  # idle 16 (a victim) is rare
        chosen = np.stack([rng.permutation(64)[:12] for _ in range(4)])
        hot_counts = rng.integers(0, 13, size=4)
        hot = np.stack([np.setdiff1d(np.arange(64), chosen[seq])[:40] for seq in range(4)])
        policy = HitPolicy(promote_hits=4)
        cold_positions = [row[count:] for row, count in zip(chosen, hot_counts)]
        may_promote = policy.may_promote(table, chosen, hot_counts, hot)
        for seq, (may, cold) in enumerate(zip(may_promote, cold_positions)):
            planned = policy.plan(table, seq, cold, np.zeros(len(cold)), hot[seq], np.zeros(len(hot[seq])))
            assert may or not len(planned)


def test_overflow_victims_are_the_coldest_per_sequence():
    table = HitTable(batch=2, capacity=4)
    table.hits[:] = [[2, 0, 1, 0], [0, 0, 0, 0]]
    _set_idle(table, [[0, 5, 0, 9], [1, 7, 3, 2]])
    victims = HitPolicy().overflow_victims(table, np.array([[0, 1, 2, 3], [0, 1, 2, 3]]), 2)
    assert victims.tolist() == [[1, 3], [1, 2]]


def test_coldest_orders_as_a_stable_sort_by_hits_then_idle():
    rng = np.random.default_rng(0)
    for _ in range(300):  # few distinct values: many ties, broken by index as a stable sort breaks them
        tokens = int(rng.integers(1, 40))
        hits = rng.integers(0, 3, size=(2, tokens)).astype(np.uint8)
        idle = rng.integers(0, 255, size=(2, tokens)).astype(np.uint8) // 64
        count = int(rng.integers(0, tokens + 1))
        expected = [np.lexsort((-idle[row].astype(np.int64), hits[row]))[:count] for row in range(2)]
        assert coldest(hits, idle, count).tolist() == [order.tolist() for order in expected]
        assert coldest(hits[0], idle[0], count).tolist() == expected[0].tolist()


def test_ping_pong_meter_counts_reversals_within_the_window():
    meter = PingPongMeter(window=10)
    meter.record(1, 0, np.array([7, 8]), -1)
    meter.record(5, 0, np.array([7]), +1)  # 7 comes back 4 steps later: ping-pong
    meter.record(30, 0, np.array([8]), +1)  # 8 after 29 steps: a legitimate move
    meter.record(31, 1, np.array([7]), +1)  # another sequence's token 7
    assert (meter.moves, meter.ping_pongs) == (5, 1)


def test_make_policy():
    assert make_policy("off", 1, 1, 1) is None
    assert type(make_policy("naive", 1, 1, 1)) is NaivePolicy and type(make_policy("hit", 1, 1, 1)) is HitPolicy
