"""The sparse cache end to end on tiny random models: exactness at alpha = 1, tiers, faults, budgets."""

import os
import signal

import numpy as np
import pytest
import torch
import tiny_models
from sparse_steps import ids as _ids, run as _run, sparse_cache as _sparse

from kvtier.errors import ConfigError
from kvtier.kv.contract import tier_bytes
from kvtier.kv.model_geometry import full_attention_layers
from kvtier.modes import KVConfig, make_cache
from kvtier.sparse.cache import make_sparse_cache
from kvtier.sparse.layer import SparseLayer
from kvtier.sparse.lookahead import MAX_AHEAD
from kvtier.sparse.settings import SparseSettings


def _dense(model, ids, steps):
    return _run(model, make_cache(model, KVConfig(), ids.shape[1] + steps), ids, steps)


def _assert_dense_equivalent(sparse, dense):
    """Exact attention over every token, summed in another order: float rounding apart, the same logits."""
    torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-5)
    assert torch.equal(sparse.argmax(-1), dense.argmax(-1))


def test_alpha_one_equals_dense_with_a_batch(tiny_llama, tmp_path):
    ids = _ids(2, 200, 1)
    cache = _sparse(tiny_llama, tmp_path, 220, batch=2, alpha=1.0)
    try:
        sparse = _run(tiny_llama, cache, ids, 6)
        tiers = [layer.tier_tokens() for layer in cache.layers]
        assert all(t["host"] > 0 and t["storage"] > 0 and sum(t.values()) == 206 for t in tiers)
        summary = cache.stats.summary()
        assert summary["selected_cold"] == summary["pooled_cold"] > 0  # alpha 1 fetched every cold token
        assert cache.runtime.scorer.host_scored_requests == 0
    finally:
        cache.close()
    _assert_dense_equivalent(sparse, _dense(tiny_llama, ids, 6))
    assert not list(tmp_path.iterdir())  # close removed the cold-pool files


def test_placement_respects_the_host_budget_and_keeps_the_window_on_the_device(tiny_llama, tmp_path):
    ids = _ids(1, 300, 2)
    cache = _sparse(tiny_llama, tmp_path, 320, host="16KiB", beta=10.0)  # beta asks for more than M0 allows
    try:
        _run(tiny_llama, cache, ids, 17)
        per_token = 2 * 2 * 16 * 4 * 2  # K+V, 2 KV heads, head_dim 16, fp32, 2 tiered layers
        max_hot = 16 * 1024 // per_token - 16
        assert cache.runtime.plan.capped and cache.runtime.hot_tokens == max_hot
        for layer in cache.layers:
            # Placed at 300 tokens (window 284..299). Decode tokens join the window; at step 16 it holds
            # 16 past the recent 16, which retire together (retire_batch 16) to the hot pool, whose
            # overflow of 16 (demote_batch) goes to the cold pool at once. Step 17 adds one more.
            assert layer.tier_tokens() == {"device": 4 + 17, "host": max_hot, "storage": 300 - 20 - max_hot + 16}
            assert list(layer.window_positions[:4]) == [0, 1, 2, 3]
            assert list(layer.window_positions[4:]) == list(range(300, 317))
        sizes = tier_bytes(cache, tiny_llama)
        assert sizes["host"] <= 16 * 1024 and sizes["storage"] > sizes["host"]
        assert cache.io_stats().bytes_read > 0
    finally:
        cache.close()


def test_sparse_attention_reads_a_fraction_of_the_cold_pool(tiny_llama, tmp_path):
    ids = _ids(1, 400, 3)
    cache = _sparse(tiny_llama, tmp_path, 420, alpha=0.1)
    try:
        _run(tiny_llama, cache, ids, 6)
        summary = cache.stats.summary()
        attended = summary["selected_hot"] + summary["selected_cold"]
        assert attended == pytest.approx(2 * np.ceil(0.1 * (summary["pooled_hot"] + summary["pooled_cold"]) / 2), abs=2)
        assert summary["selected_cold"] < summary["pooled_cold"]
    finally:
        cache.close()


def _steps_with_sketch_scores(model, tmp_path, ids, scores_of, **settings):
    """The logits of 6 steps (no lookahead: every layer asks the scorer for scores), the scorer's scores passed
    through `scores_of` on their way to the layer."""
    tmp_path.mkdir()
    cache = _sparse(model, tmp_path, 420, alpha=0.1, lookahead=False, **settings)
    scorer = cache.runtime.scorer
    real = scorer.scores
    scorer.scores = lambda: scores_of(real())
    try:
        return _run(model, cache, ids, 6)
    finally:
        cache.close()


def test_the_sketches_draw_up_the_shortlist_and_exact_scores_choose(tiny_llama, tmp_path):
    """With every cold token shortlisted the choice is the exact top-alpha whatever the sketches say: INT4 and INT8
    sketches, or their scores upside down, attend the same tokens. With the narrowest shortlist the scores upside
    down do change the choice: the shortlist is drawn from them."""
    ids = _ids(1, 400, 3)
    everything = {"candidate_margin": 1000.0}
    as_they_are = _steps_with_sketch_scores(tiny_llama, tmp_path / "a", ids, lambda scores: scores, **everything)
    upside_down = _steps_with_sketch_scores(tiny_llama, tmp_path / "b", ids, lambda scores: -scores, **everything)
    int4 = _steps_with_sketch_scores(tiny_llama, tmp_path / "c", ids, lambda scores: scores, score_bits=4,
                                     **everything)
    assert torch.equal(as_they_are, upside_down) and torch.equal(as_they_are, int4)
    narrow = _steps_with_sketch_scores(tiny_llama, tmp_path / "d", ids, lambda scores: -scores, candidate_margin=1.0)
    assert not torch.equal(as_they_are, narrow)


# the second layer's candidates prefetched with a predicted query (lookahead.py), however small its cold pool
LOOKAHEAD = {"lookahead_skip": 1, "lookahead_min_cold": 1}
# ... or scored as they come
WITH_AND_WITHOUT_LOOKAHEAD = pytest.mark.parametrize("lookahead", [{"lookahead": False}, LOOKAHEAD],
                                                     ids=["in-order", "lookahead"])


@WITH_AND_WITHOUT_LOOKAHEAD
def test_killing_the_scorer_mid_generation_changes_nothing(tiny_llama, tmp_path, lookahead):
    ids = _ids(1, 300, 4)
    reference_cache = _sparse(tiny_llama, tmp_path, 320, alpha=0.3, **lookahead)
    try:
        reference = _run(tiny_llama, reference_cache, ids, 6)
    finally:
        reference_cache.close()

    def kill_at_step_3(step, cache):
        if step == 3:
            os.kill(cache.runtime.scorer.process.pid, signal.SIGKILL)
            cache.runtime.scorer.process.wait()

    cache = _sparse(tiny_llama, tmp_path, 320, alpha=0.3, **lookahead)
    try:
        faulty = _run(tiny_llama, cache, ids, 6, between_steps=kill_at_step_3)
        assert cache.runtime.scorer.host_scored_requests == 1 and cache.runtime.scorer.restarts == 1
    finally:
        cache.close()
    assert torch.equal(reference, faulty)


@WITH_AND_WITHOUT_LOOKAHEAD
def test_a_scorer_crash_inside_a_request_changes_nothing(tiny_llama, tmp_path, lookahead):
    ids = _ids(1, 300, 5)
    reference_cache = _sparse(tiny_llama, tmp_path, 310, alpha=0.3, **lookahead)
    try:
        reference = _run(tiny_llama, reference_cache, ids, 3)
    finally:
        reference_cache.close()
    cache = _sparse(tiny_llama, tmp_path, 310, alpha=0.3, crash_scorer_after_blocks=7,
                    score_block_tokens=64, **lookahead)  # several blocks per layer: the crash lands mid-layer
    try:
        faulty = _run(tiny_llama, cache, ids, 3)
        assert cache.runtime.scorer.host_scored_requests == 1
    finally:
        cache.close()
    assert torch.equal(reference, faulty)


def test_gemma3_sliding_layers_stay_dense_and_alpha_one_matches(tiny_gemma3, tmp_path):
    ids = _ids(1, 150, 6)
    cache = _sparse(tiny_gemma3, tmp_path, 160, alpha=1.0)
    try:
        sparse = _run(tiny_gemma3, cache, ids, 6)
        kinds = [type(layer).__name__ for layer in cache.layers]
        assert kinds == ["DynamicSlidingWindowLayer", "SparseLayer", "DynamicSlidingWindowLayer"]
        assert cache.layers[0].keys.shape[2] <= 16
    finally:
        cache.close()
    _assert_dense_equivalent(sparse, _dense(tiny_gemma3, ids, 6))


@WITH_AND_WITHOUT_LOOKAHEAD
def test_migration_swaps_tokens_within_bounds(tiny_llama, tmp_path, lookahead):
    ids = _ids(1, 300, 7)
    reference = make_cache(tiny_llama, KVConfig(), 300)
    _run(tiny_llama, reference, ids, 0)  # the prompt's true K/V
    cache = _sparse(tiny_llama, tmp_path, 340, alpha=0.2, policy="naive", max_moves=3, **lookahead)
    try:
        _run(tiny_llama, cache, ids, 8)
        steps = cache.stats.steps
        assert sum(step.promotions for step in steps) > 0
        assert all(step.promotions <= 3 * 2 for step in steps)  # 3 per layer, 2 tiered layers
        for layer in cache.layers:  # every pooled token is in exactly one pool
            cache.runtime.cold.settle(layer.tier)  # the last step's moves are written in the background
            hot = set(layer.hot.positions[0, : layer.hot.used].tolist())
            cold = set(cache.runtime.cold.positions[layer.tier, 0, : cache.runtime.cold.used[layer.tier]].tolist())
            window = set(layer.window_positions.tolist())
            assert not hot & cold and not (hot | cold) & window
            assert hot | cold | window == set(range(308))
            # promoted tokens brought their own K/V into the hot pool (the prompt's are known exactly)
            slots = np.flatnonzero(layer.hot.positions[0, : layer.hot.used] < 300)
            positions = torch.from_numpy(layer.hot.positions[0, slots])
            true_keys = reference.layers[layer.layer_idx].keys[0][:, positions]
            torch.testing.assert_close(layer.hot.keys_of(0, slots), true_keys)
        moves, _ = cache.ping_pong()
        assert moves == 2 * sum(step.promotions for step in steps)
    finally:
        cache.close()


def test_a_device_budget_below_the_window_is_refused(tiny_llama, tmp_path):
    settings = SparseSettings(sink=4, recent=64)
    with pytest.raises(ConfigError, match="--device-kv-budget"):
        make_sparse_cache(tiny_llama, settings, 100, 1, str(tmp_path), device_budget=1024, host_budget=2**20,
                          tiered_layers=[0, 1])


def test_kv_config_builds_a_sparse_cache(tiny_llama, tmp_path):
    config = KVConfig(kv="sparse", alpha=0.5, score_bits=4, beta="1.5", sink=2, recent=8, storage_dir=str(tmp_path))
    cache = make_cache(tiny_llama, config, 100)
    try:
        settings = cache.runtime.settings
        assert (settings.alpha, settings.score_bits, settings.beta, settings.sink, settings.recent) == (0.5, 4, 1.5, 2, 8)
        assert all(isinstance(layer, SparseLayer) for layer in cache.layers)
    finally:
        cache.close()
    with pytest.raises(ConfigError, match="--alpha"):
        KVConfig(kv="sparse", alpha=0).validated()
    with pytest.raises(ConfigError, match="--beta"):
        KVConfig(kv="sparse", beta="fast").validated()


def test_watched_positions_are_sink_selected_recent_and_new_token(tiny_llama, tmp_path):
    ids = _ids(1, 120, 2)
    cache = _sparse(tiny_llama, tmp_path, 130, alpha=0.25)
    seen = []
    cache.watch_attended(lambda layer, positions: seen.append((layer, positions.copy())))
    try:
        _run(tiny_llama, cache, ids, 2)
    finally:
        cache.close()
    assert sorted({layer for layer, _ in seen}) == [0, 1]
    layer, positions = seen[-1]
    # last step: 122 tokens, minus the sink and the window's 18 (recent 16 + 2 decode tokens, none retired yet)
    pooled = 122 - 4 - 18
    assert positions.shape == (1, 4 + int(np.ceil(0.25 * pooled)) + 18)
    assert list(positions[0, :4]) == [0, 1, 2, 3] and positions[0, -1] == 121
    assert len(set(positions[0].tolist())) == positions.shape[1]


def test_the_prompt_is_placed_in_its_tiers_at_the_end_of_prefill(tiny_llama, tmp_path):
    ids = _ids(1, 200, 7)
    cache = _sparse(tiny_llama, tmp_path, 220)
    try:
        with torch.inference_mode():
            logits = tiny_llama(input_ids=ids, cache=cache).logits[:, -1]
        assert not any(layer.distributed for layer in cache.layers)
        cache.place_prompt()  # what kvtier.generate and the benchmarks call once prefill is done
        tiers = [layer.tier_tokens() for layer in cache.layers]
        assert all(t["storage"] > 0 and t["host"] > 0 and sum(t.values()) == 200 for t in tiers)
        assert cache.stats.steps == []  # no decode step has run: placement is not billed to one
        with torch.inference_mode():  # decoding goes on from the placed tiers
            for _ in range(2):
                logits = tiny_llama(input_ids=logits.argmax(-1, keepdim=True), cache=cache).logits[:, -1]
        assert [layer.tier_tokens()["device"] for layer in cache.layers] == [4 + 16 + 2] * 2
        assert len(cache.stats.steps) == 2
    finally:
        cache.close()


def test_alpha_one_with_lookahead_equals_dense(tiny_llama, tmp_path):
    ids = _ids(2, 200, 12)
    cache = _sparse(tiny_llama, tmp_path, 220, batch=2, alpha=1.0, **LOOKAHEAD)
    try:
        sparse = _run(tiny_llama, cache, ids, 6)
        summary, steps = cache.stats.summary(), cache.stats.steps
        # the first step reads its own (a layer is asked for as many candidates as it chose cold tokens last step); from
        # the second on, the second layer takes candidates predicted from the first's input and the first those asked
        # for at the end of the step before, with the query it attended with there
        assert steps[0].lookahead_layers == 0 and steps[0].unpredicted_fetch_s == steps[0].fetch_s > 0
        assert [step.lookahead_layers for step in steps[1:]] == [2] * (len(steps) - 1)
        assert summary["unpredicted_fetch_s"] == 0 < summary["fetch_s"]
        assert summary["selected_cold"] == summary["pooled_cold"] > 0  # at alpha 1 every cold token is a candidate
    finally:
        cache.close()
    _assert_dense_equivalent(sparse, _dense(tiny_llama, ids, 6))


def test_the_predicted_layers_are_folded_before_the_first_step(tmp_path):
    """Folding a layer's query projection costs a decode step a few hundred microseconds a layer: done at set-up,
    for the layers the lookahead predicts (after the first `lookahead_skip`) and only those."""
    model = tiny_models.tiny_llama(num_hidden_layers=4)
    cache = _sparse(model, tmp_path, 100, lookahead_skip=2, lookahead_min_cold=1)
    try:
        assert sorted(cache.runtime.lookahead.forecast._folded_projections) == [2, 3]
    finally:
        cache.close()


def test_lookahead_attends_top_alpha_of_hot_pool_and_candidates(tiny_llama, tmp_path):
    ids = _ids(1, 400, 13)
    cache = _sparse(tiny_llama, tmp_path, 420, alpha=0.1, **LOOKAHEAD)
    try:
        _run(tiny_llama, cache, ids, 8)
        steps = [step for step in cache.stats.steps if step.lookahead_layers]
        assert steps
        for step in steps:  # two tiered layers, one sequence: k per layer is ceil(alpha * pooled)
            assert step.selected_hot + step.selected_cold == 2 * np.ceil(0.1 * (step.pooled_hot + step.pooled_cold) / 2)
            assert step.cold_bytes_fetched > 0
    finally:
        cache.close()


def test_layers_with_small_cold_pools_keep_the_exact_path(tiny_llama, tmp_path):
    ids = _ids(1, 300, 15)
    cache = _sparse(tiny_llama, tmp_path, 320, alpha=0.2, lookahead_skip=1, lookahead_min_cold=10_000)
    try:
        _run(tiny_llama, cache, ids, 4)
        summary = cache.stats.summary()
        assert summary["pooled_cold"] > 0 and summary["selected_cold"] > 0
        assert summary["lookahead_layers"] == 0 and cache.runtime.lookahead.in_flight == ()
        assert summary["unpredicted_fetch_s"] == summary["fetch_s"] > 0  # every layer read on the critical path
    finally:
        cache.close()


def test_a_step_that_fails_with_a_prefetch_in_flight_still_closes_cleanly(tiny_llama, tmp_path):
    ids = _ids(1, 300, 14)
    cache = _sparse(tiny_llama, tmp_path, 320, alpha=0.2, **LOOKAHEAD)
    _run(tiny_llama, cache, ids, 3)

    def fail_after_the_first_layer(layer, _positions):
        if layer == 0:  # the second layer's candidates are at the scorer or on their way from the disk
            raise RuntimeError("injected")

    cache.watch_attended(fail_after_the_first_layer)
    with pytest.raises(RuntimeError, match="injected"), torch.inference_mode():
        tiny_llama(input_ids=ids[:, -1:], cache=cache)
    assert cache.runtime.lookahead.in_flight[:1] == (1,)  # left in flight by the failed step
    cache.close()
    assert not list(tmp_path.iterdir())


def test_layers_whose_candidates_come_late_are_asked_for_earlier_and_stay_exact(tmp_path, monkeypatch):
    model = tiny_models.tiny_llama(num_hidden_layers=5)
    monkeypatch.setattr("kvtier.sparse.lookahead.LATE_WAIT_S", -1.0)  # every wait counts as late
    ids = _ids(1, 200, 16)
    cache = _sparse(model, tmp_path, 220, alpha=1.0, **LOOKAHEAD)
    in_flight = []
    cache.watch_attended(lambda _layer, _positions: in_flight.append(len(cache.runtime.lookahead.in_flight)))
    try:
        sparse = _run(model, cache, ids, 6)
        assert cache.runtime.lookahead.ahead == [1] + [MAX_AHEAD] * 4  # per tier; tier 0 is asked for a step ahead
        assert max(in_flight) == MAX_AHEAD  # while a layer attends, the next three layers' requests are out
    finally:
        cache.close()
    _assert_dense_equivalent(sparse, _dense(model, ids, 6))


def _estimated_and_exact_mass(model, cache, ids, steps):
    """Per decode step and tiered layer: the layer, the mass the cache estimates it kept, and the mass a dense cache
    fed the same tokens puts on the positions it attended (the lockstep of `bench accuracy`). Past the first layer
    the two caches' queries differ (the sparse one's earlier layers attended fewer tokens)."""
    from kvtier.eval.accuracy.mass_recall import AttendedPositions, DenseAttentionProbe

    dense = make_cache(model, KVConfig(), ids.shape[1] + steps)
    attended, estimated, pairs = AttendedPositions(), {}, []
    cache.watch_attended(attended)
    cache.watch_mass(lambda layer, kept: estimated.__setitem__(layer, float(kept[0])))
    with DenseAttentionProbe(model) as probe, torch.inference_mode():
        for start in range(0, ids.shape[1], 64):
            logits = model(input_ids=ids[:, start : start + 64], cache=cache).logits[:, -1]
            model(input_ids=ids[:, start : start + 64], cache=dense)
        for _ in range(steps):
            token = logits.argmax(-1, keepdim=True)
            logits = model(input_ids=token, cache=cache).logits[:, -1]
            with probe.capturing():
                model(input_ids=token, cache=dense)
            pairs += [(layer, estimated[layer], exact) for layer, exact in probe.recall(attended.take()).items()]
    return pairs


@pytest.mark.parametrize("bits", [4, 8])
def test_the_estimated_mass_is_exact_at_alpha_one_whatever_the_sketches(tiny_llama, tmp_path, bits):
    """At alpha 1 every cold token is read: the estimate takes no logit from a sketch, so it is exact at any sketch
    precision (there are no 16-bit sketches to make the unread tokens' logits exact)."""
    cache = _sparse(tiny_llama, tmp_path, 220, alpha=1.0, score_bits=bits)
    try:
        pairs = _estimated_and_exact_mass(tiny_llama, cache, _ids(1, 200, 21), 4)
    finally:
        cache.close()
    assert len(pairs) == 8
    for _, estimate, exact in pairs:
        assert estimate == pytest.approx(exact, abs=1e-5) and exact == pytest.approx(1.0, abs=1e-5)


def test_the_estimated_mass_is_exact_where_every_cold_token_is_read(tiny_llama, tmp_path):
    """A cold pool of a few tokens: the shortlist (at least MIN_CANDIDATES) reads all of it, so every logit is known
    and the top-p choice's estimated mass is the dense mass of what it attended, below 1, in the first layer (whose
    query is the dense cache's); in the next, the queries' difference keeps them near."""
    cache = _sparse(tiny_llama, tmp_path, 220, beta=12.0, host="256KiB", top_p=0.6, min_share=0.0, max_share=1.0,
                    guard_mass=0.0, lookahead=False)
    try:
        pairs = _estimated_and_exact_mass(tiny_llama, cache, _ids(1, 200, 22), 4)
        assert 0 < cache.layers[0].tier_tokens()["storage"] <= 16
    finally:
        cache.close()
    for layer, estimate, exact in pairs:
        assert estimate == pytest.approx(exact, abs=1e-5 if layer == 0 else 0.01) and 0.59 <= exact < 0.999
    assert any(layer == 0 for layer, _, _ in pairs)


@pytest.mark.parametrize("lookahead", [{}, LOOKAHEAD])
def test_the_top_p_budget_attends_between_its_floor_and_ceiling_and_counts_guards(tiny_llama, tmp_path, lookahead):
    ids = _ids(1, 400, 23)
    cache = _sparse(tiny_llama, tmp_path, 420, top_p=0.9, min_share=0.05, max_share=0.3, guard_mass=0.0,
                    **lookahead)
    try:
        _run(tiny_llama, cache, ids, 6)
        report = cache.attention_budget()
        for step in cache.stats.steps:
            pooled = (step.pooled_hot + step.pooled_cold) / 2  # two tiered layers, one sequence each
            assert 2 * np.ceil(0.05 * pooled) <= step.selected_hot + step.selected_cold <= 2 * np.ceil(0.3 * pooled)
        assert report["guard_events"] == 0 and 0 < report["mass_kept_min"] <= report["mass_kept_mean"] <= 1
    finally:
        cache.close()
