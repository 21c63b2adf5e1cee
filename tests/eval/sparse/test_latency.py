"""The latency suite's cells and runner on a tiny random model: grids, budgets, records, skipped cells.

Mechanics only: no assertion here is about speed.
"""

from dataclasses import replace

import pytest

from kvtier.errors import ConfigError
from kvtier.eval.sparse.latency import RunOptions, cell_config, median_fields, prompt_batch, run_cell, run_pending
from kvtier.eval.sparse.latency_grid import (ABLATION_STEPS, BETA_SWEEP_HOST_SHARE, GRIDS, experiment_cells,
                                      parse_experiments, parse_modes, workload)
from kvtier.eval.record import ResultStore
from kvtier.eval.sparse.traffic import DIRECTIONS, O_DIRECT
from kvtier.modes import KV_MODES
from kvtier.units import parse_size

GRID = replace(GRIDS["small"], contexts=(256, 512), fixed_context=256, new_tokens=2, batches=(1, 2),
               stress_batches=(3,), batch_input=256, batch_output=2, betas=(0.5, 2.0), alphas=(0.1, 0.3),
               needle_depths=(0.5,))
MODES = ("dense", "offload", "sparse")
SPREAD_FIELDS = {"median", "min", "max", "n"}


@pytest.fixture
def options(tmp_path, corpus_text):
    return RunOptions(str(tmp_path), corpus_text)


def test_context_cells_cover_every_context_with_modes_innermost():
    cells = experiment_cells("a", GRID, MODES, repeats=3, host_share=0.4)
    assert [(cell.context, cell.mode) for cell in cells] == [(c, m) for c in (256, 512) for m in MODES]
    assert len({cell.key for cell in cells}) == len(cells)
    assert all(cell.repeats == 3 and cell.batch == 1 and cell.new_tokens == 2 for cell in cells)


def test_batch_cells_add_stress_runs_with_capped_repeats():
    cells = experiment_cells("b", GRID, MODES, repeats=3, host_share=0.4)
    regular, stress = [c for c in cells if not c.stress], [c for c in cells if c.stress]
    assert sorted({c.batch for c in regular}) == [1, 2] and {c.batch for c in stress} == {3}
    assert {c.repeats for c in regular} == {3} and {c.repeats for c in stress} == {GRID.stress_repeats}
    assert {c.context for c in cells} == {GRID.batch_input} and {c.new_tokens for c in cells} == {GRID.batch_output}


def test_ablation_adds_hkm_then_app_after_the_prefetch_baseline():
    cells = experiment_cells("c", GRID, MODES, repeats=1, host_share=0.4)
    assert [cell.variant for cell in cells] == list(ABLATION_STEPS)
    prefetch, no_migration, hkm, hkm_app = cells
    assert prefetch.mode == "infinigen" and prefetch.policy is None
    assert (no_migration.policy, hkm.policy, hkm_app.policy) == ("off", "hit", "hit")
    assert no_migration.beta == hkm.beta == pytest.approx(0.2 / 0.8) and hkm_app.beta == "auto"


def test_beta_sweep_gives_the_host_the_whole_prompt_and_ends_with_app():
    cells = experiment_cells("d", GRID, MODES, repeats=1, host_share=0.4)
    assert [cell.beta for cell in cells] == [0.5, 2.0, "auto"]
    assert {cell.host_share for cell in cells} == {BETA_SWEEP_HOST_SHARE}
    assert {cell.mode for cell in cells} == {"sparse"}


def test_alpha_sweep_runs_selective_modes_per_alpha_and_dense_once_all_with_needles():
    cells = experiment_cells("e", GRID, MODES, repeats=1, host_share=0.4)
    assert [(cell.mode, cell.alpha) for cell in cells] == [("dense", 0.2), ("sparse", 0.1), ("sparse", 0.3)]
    assert all(cell.needles == ((0.5, 0),) for cell in cells)


def test_parse_experiments_and_modes_name_what_exists():
    assert parse_experiments("c,context, a") == ("c", "a")
    assert parse_modes(None) == KV_MODES and parse_modes("sparse,dense") == ("sparse", "dense")
    with pytest.raises(ConfigError, match="unknown experiment 'z'.*a \\(context\\)"):
        parse_experiments("a,z")
    with pytest.raises(ConfigError, match="unknown KV mode fast; choose from dense"):
        parse_modes("dense,fast")


def test_workload_counts_prompt_tokens_and_steps_of_every_repeat():
    cells = experiment_cells("b", GRID, ("dense",), repeats=2, host_share=0.4)
    prefill, steps = workload(cells)
    assert prefill == 2 * 256 * (1 + 2) + 1 * 256 * 3
    assert steps == (2 + 2 + 1) * (GRID.batch_output + 1)


def test_budgets_are_shares_of_the_prompt_kv_times_the_batch(tiny_llm, options):
    cell = replace(experiment_cells("a", GRID, ("offload",), 1, 0.4)[1], batch=3)  # context 512
    config = cell_config(tiny_llm.model, cell, options)
    single = cell_config(tiny_llm.model, replace(cell, batch=1), options)
    assert parse_size(config.host_kv_budget) == 3 * parse_size(single.host_kv_budget) == 3 * int(0.4 * 512 * 512)
    assert parse_size(config.device_kv_budget) == 3 * parse_size(single.device_kv_budget)


def test_prompt_rows_are_different_stretches_and_short_texts_repeat(tiny_llm, corpus_text):
    ids = prompt_batch(tiny_llm.tokenizer, corpus_text, 64, 3)
    assert ids.shape == (3, 64) and not bool((ids[0] == ids[1]).all())
    short = prompt_batch(tiny_llm.tokenizer, "the red lighthouse", 10, 1)
    assert short.shape == (1, 10) and short[0, :3].tolist() == short[0, 3:6].tolist()


@pytest.mark.parametrize("mode", MODES)
def test_a_cell_records_spreads_budgets_traffic_and_cache_bypass(tiny_llm, options, mode):
    cell = experiment_cells("a", GRID, (mode,), repeats=2, host_share=0.4)[0]
    result = run_cell(tiny_llm, cell, options)
    assert result["params"]["mode"] == mode and result["repeats"] == 2
    for name in ("ms_per_token", "prefill_s", "latency_s", "tokens_per_s", "disk_read_bytes_per_step"):
        assert set(result[name]) == SPREAD_FIELDS and result[name]["n"] == 2
    assert set(result["traffic_bytes_per_step"]) == set(DIRECTIONS)
    assert result["budgets"]["prompt_kv_bytes"] == 256 * 512
    if mode == "dense":
        assert result["cache_bypass"] is None and not any(result["traffic_bytes_per_step"].values())
    else:
        assert result["cache_bypass"] == O_DIRECT  # tmp_path is on a filesystem with O_DIRECT here
        assert result["traffic_bytes_per_step"]["storage->host"] > 0 and result["kv_bytes"]["storage"] > 0
    if mode == "sparse":
        beta = result["sparse"]["beta"]  # "inf" (all hot; JSON has no infinity) on a pool this small
        assert (beta == "inf" or beta > 0) and set(result["sparse"]["breakdown_ms"]) >= {"score", "fetch"}


def test_offload_moves_every_pooled_token_to_the_device_each_step(tiny_llm, options):
    result = run_cell(tiny_llm, experiment_cells("f", GRID, ("offload",), 1, 0.4)[0], options)
    traffic, resident = result["traffic_bytes_per_step"], result["kv_bytes"]
    assert traffic["host->device"] == resident["host"] + resident["storage"]


def test_ablation_cell_with_migration_off_runs_the_sparse_cache_with_that_policy(tiny_llm, options):
    no_migration = experiment_cells("c", GRID, MODES, repeats=1, host_share=0.4)[1]
    result = run_cell(tiny_llm, no_migration, options)
    assert result["params"]["policy"] == "off" and result["sparse"]["promotions_per_step"] == 0
    assert result["sparse"]["beta"] == pytest.approx(no_migration.beta)


def test_alpha_cell_scores_its_needles(tiny_llm, options):
    cell = experiment_cells("e", GRID, MODES, repeats=1, host_share=0.4)[1]
    accuracy = run_cell(tiny_llm, cell, options)["accuracy"]
    assert accuracy["n"] == 1 and accuracy["correct"] in (0, 1)
    assert set(accuracy["answers"][0]) == {"depth", "seed", "correct", "answer", "expected"}


def test_finished_cells_are_skipped_on_a_rerun(tiny_llm, options, tmp_path):
    cells = experiment_cells("f", GRID, ("dense",), repeats=1, host_share=0.4)
    path = tmp_path / "latency-traffic.json"
    first = list(run_pending(tiny_llm, cells, ResultStore(path, {"model": "tiny"}, tmp_path), options))
    store = ResultStore(path, {"model": "tiny"}, tmp_path)
    assert [cell for cell, _ in first] == cells and store.done(cells[0].key)
    assert list(run_pending(tiny_llm, cells, store, options)) == []
    assert store.data["machine"]["cpu_cores"] >= 1 and store.get(cells[0].key) == first[0][1]


def test_median_fields_takes_medians_of_numbers_and_the_first_of_everything_else():
    records = [{"a": 1, "nested": {"b": 2.0}, "flag": True, "text": "x"},
               {"a": 5, "nested": {"b": 4.0}, "flag": False, "text": "y"},
               {"a": 3, "nested": {"b": 9.0}, "flag": False, "text": "z"}]
    assert median_fields(records) == {"a": 3, "nested": {"b": 4.0}, "flag": True, "text": "x"}
