"""REPORT.md and its plots from synthetic result files: every section, determinism, missing pieces, errors."""

import json
import sys
from dataclasses import replace

import pytest

from kvtier.errors import ConfigError, StorageError
from kvtier.eval.sparse.latency_grid import EXPERIMENTS, GRIDS, experiment_cells
from kvtier.eval.record import ResultStore, cell_key
from kvtier.eval.sparse.corpora_table import corpora_result
from kvtier.eval.report.markdown_report import PLOTS_DIR, REPORT_NAME, appendices, demote_headings, write_report
from kvtier.eval.sparse.traffic import DIRECTIONS

GRID = replace(GRIDS["small"], contexts=(1024, 2048), batches=(1, 2), stress_batches=(20,), betas=(0.5, 2.0),
               alphas=(0.1, 0.3))
MODES = ("dense", "offload", "sparse")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
APP_BETA = 3.0


def _spread(value: float) -> dict:
    return {"median": value, "min": 0.9 * value, "max": 1.1 * value, "n": 3}


def _result(cell, ms: float) -> dict:
    """A cell result shaped like kvtier.eval.sparse.latency.run_cell's."""
    result = {"params": cell.params(), "repeats": 3, "ms_per_token": _spread(ms), "prefill_s": _spread(1.0),
              "decode_s": _spread(0.1), "latency_s": _spread(1.0 + ms / 100), "tokens_per_s": _spread(10.0),
              "disk_read_bytes_per_step": _spread(4096.0), "disk_written_bytes_per_step": _spread(0.0),
              "traffic_bytes_per_step": {direction: 1024.0 * (i + 1) for i, direction in enumerate(DIRECTIONS)},
              "kv_bytes": {"device": 1, "host": 2, "storage": 3},
              "cache_bypass": None if cell.mode == "dense" else "O_DIRECT",
              "budgets": {"device_kv_budget": 1 << 20, "host_kv_budget": 4 << 20, "prompt_kv_bytes": 10 << 20}}
    if cell.mode == "sparse":
        result["sparse"] = {"beta": APP_BETA if cell.beta == "auto" else cell.beta, "capped_by_host_budget": False,
                            "hot_share": 0.5, "predicted_ms": {"T_CPU": 1.0 if cell.beta == "auto" else 0.0,
                                                              "T_storage": 1.5 if cell.beta == "auto" else 0.0}}
    if cell.needles:
        correct = int(cell.alpha >= 0.2)
        result["accuracy"] = {"correct": correct, "n": 1, "accuracy": float(correct), "answers": []}
    return result


def _write_latency_file(directory, letter: str, speed=lambda cell: 10.0) -> None:
    experiment = EXPERIMENTS[letter]
    settings = {"model": "tiny", "grid": "small", "repeats": 3, "host_share": 0.4, "alpha": 0.2, "device_share": 0.02,
                "warmup_steps": 1, "torch_threads": 1, "corpus": {"name": "generated"}, "experiment": experiment.name,
                "title": experiment.title, "new_tokens": 8}
    store = ResultStore(directory / f"latency-{experiment.name}-tiny-small.json", settings, directory)
    for cell in experiment_cells(letter, GRID, MODES, repeats=3, host_share=0.4):
        store.put(cell.key, _result(cell, speed(cell)))


def _write_accuracy_file(directory) -> None:
    store = ResultStore(directory / "accuracy-tiny.json", {"model": "tiny"}, directory)
    for mode, correct, ppl in (("dense", True, 10.0), ("sparse", False, 10.5)):
        needle = {"kind": "needle", "mode": mode, "context": 1024, "seed": 0, "depth": 0.5, "variant": "single"}
        store.put(cell_key(**needle), needle | {"correct": correct, "ms_per_token": 5.0})
        perplexity = {"kind": "ppl", "mode": mode, "context": 1024, "seed": 0, "tokens": 8}
        store.put(cell_key(**perplexity), perplexity | {"ppl": ppl, "attention_mass_recall": 0.9})


def _write_ruler_file(directory) -> None:
    store = ResultStore(directory / "ruler-tiny.json", {"model": "tiny"}, directory)
    for mode, score in (("dense", 1.0), ("quest", 0.5)):
        cell = {"task": "niah_single_essay", "context": 2048, "seed": 0, "mode": mode}
        store.put(cell_key(**cell), cell | {"score": score, "token_ids": [1]})


@pytest.fixture
def results(tmp_path):
    for letter in EXPERIMENTS:
        _write_latency_file(tmp_path, letter)
    _write_accuracy_file(tmp_path)
    _write_ruler_file(tmp_path)
    return tmp_path


def _plots_of(report: str) -> list[str]:
    return [line.rsplit("](", 1)[1].rstrip(")") for line in report.splitlines() if line.startswith("![")]


def test_every_section_has_a_table_and_a_png(results):
    path, plots = write_report(results)
    report = path.read_text()
    assert path == results / REPORT_NAME and "Not run yet" not in report
    for experiment in EXPERIMENTS.values():
        assert f"## ({experiment.letter}) {experiment.title}" in report
    assert "## Accuracy (kvtier bench accuracy)" in report and "| sparse | 0/1 (0%) | 0.00 | 1024: +0.500 |" in report
    assert "## RULER-style suite (kvtier bench ruler)" in report and "| quest | 0.500 | - | - | 0.500 |" in report
    referenced = _plots_of(report)
    assert len(referenced) == len(EXPERIMENTS) + 2 == len(plots)
    for name in referenced:
        assert name.startswith(f"{PLOTS_DIR}/") and (results / name).read_bytes().startswith(PNG_MAGIC)
    assert any(line.startswith("Machine: ") and " cores " in line for line in report.splitlines())
    assert "| 20 (stress) |" in report and "O_DIRECT" in report


def test_the_same_files_give_the_same_report_and_plots(results):
    first, plots = write_report(results)
    text, images = first.read_text(), [plot.read_bytes() for plot in plots]
    second, again = write_report(results)
    assert second.read_text() == text and [plot.read_bytes() for plot in again] == images


def test_experiments_without_files_say_not_run_yet(tmp_path):
    report = write_report(tmp_path)[0].read_text()
    for letter in EXPERIMENTS:
        assert f"_Not run yet: `kvtier bench latency --experiments {letter}`._" in report
    assert "_Not run yet: `kvtier bench accuracy`._" in report and _plots_of(report) == []
    assert "_Not run yet: `kvtier bench ruler`._" in report


def test_ablation_rows_follow_the_paper_and_beta_names_minimum_and_app(tmp_path):
    _write_latency_file(tmp_path, "c")
    _write_latency_file(tmp_path, "d", speed=lambda cell: {0.5: 20.0, 2.0: 8.0}.get(cell.beta, 9.0))
    report = write_report(tmp_path)[0].read_text()
    rows = [line.split("|")[1].strip() for line in report.splitlines() if line.startswith("| ")]
    ablation = [row for row in rows if row.startswith(("prefetch", "sparse,", "+HKM"))]
    assert ablation == ["prefetch (infinigen)", "sparse, no migration (beta 0.25)", "+HKM (hit table, beta 0.25)",
                        "+HKM+APP (hit table, beta auto)"]
    assert "Measured minimum at beta 2.0 (8.0 ms per step). APP chose beta 3: 9.0 ms per step." in report
    assert "| auto -> 3 | 9.0 [8.1, 9.9] (n=3) | 0.50 | 1.00 / 1.50 |" in report


def test_appendices_come_last_with_their_headings_demoted(tmp_path):
    report = write_report(tmp_path, [("Serve benchmark", "# Serve\n\ntext\n## Part\n")])[0].read_text()
    assert report.rstrip().endswith("## Serve benchmark\n\n### Serve\n\ntext\n#### Part")
    assert demote_headings("# a\nb #\n## c") == "### a\nb #\n#### c"


def test_missing_matplotlib_is_one_clear_error_and_writes_nothing(results, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(ConfigError, match=r"matplotlib.*pip install 'kvtier\[bench\]'"):
        write_report(results)
    assert not (results / REPORT_NAME).exists()


def test_a_corrupt_results_file_is_named(tmp_path):
    (tmp_path / "latency-context-x-small.json").write_text("{oops")
    with pytest.raises(StorageError, match="latency-context-x-small.json"):
        write_report(tmp_path)


def test_a_file_without_finished_cells_says_so(tmp_path):
    _write_latency_file(tmp_path, "a")
    path = tmp_path / "latency-context-tiny-small.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data | {"cells": {}}))
    assert "_No finished cells yet._" in write_report(tmp_path)[0].read_text()


SPARSE_RESULT = {"model": "tiny", "context": 256, "batch": 1, "alpha": 0.2, "score_bits": 8, "host_budget_bytes": 4096,
                 "prompt_kv_bytes": 8192, "new_tokens": 2, "torch_threads": 1, "modes": {}, "recall": {}}


def test_appendices_render_sparse_files_in_name_order(tmp_path):
    for context in (512, 256):
        (tmp_path / f"sparse-tiny-{context}-b1.json").write_text(json.dumps(SPARSE_RESULT | {"context": context}))
    titles = [title for title, _ in appendices(tmp_path)]
    assert titles == ["Sparse vs offload (`sparse-tiny-256-b1.json`)", "Sparse vs offload (`sparse-tiny-512-b1.json`)"]


def test_a_run_over_corpora_is_rendered_as_its_table(tmp_path):
    run = SPARSE_RESULT | {"corpus": "code", "device": "cpu", "repeats": 1}
    (tmp_path / "sparse-corpora-tiny-256-b1.json").write_text(json.dumps(corpora_result({"code": run})))
    [(title, text)] = appendices(tmp_path)
    assert title == "Sparse vs offload (`sparse-corpora-tiny-256-b1.json`)"
    assert text.startswith("# sparse vs offload over corpora: tiny")
