"""`kvtier bench sparse` end to end on a tiny local model: result files, every mode, recall table, errors.

Mechanics only: no assertion here is about speed.
"""

import json

import pytest

from kvtier.cli import main
from kvtier.sparse.threads import decode_threads


def _bench(model_dir, tmp_path, *extra):
    return main(["bench", "sparse", "--model", str(model_dir), "--context", "320", "--batch", "2", "--new-tokens", "3",
                 "--corpus", "generated", "--prefill-chunk", "128", "--storage-dir", str(tmp_path / "kv"),
                 "--out", str(tmp_path / "out"), "--kv-store", str(tmp_path / "store"), *extra])


def test_sparse_and_offload_side_by_side(tiny_model_dir, tmp_path, capsys):
    assert _bench(tiny_model_dir, tmp_path, "--repeats", "2") == 0
    stem = tmp_path / "out" / f"sparse-{tiny_model_dir.name}-320-b2"
    result = json.loads(stem.with_suffix(".json").read_text())
    assert set(result["modes"]) == {"dense", "offload", "sparse-hit", "sparse-naive"}
    assert result["modes"]["dense"]["disk_read_bytes_per_step"] == 0  # the reference keeps everything in memory
    assert result["machine"]["cpu_cores"] >= 1 and result["machine"]["disk"]
    offload, sparse = result["modes"]["offload"], result["modes"]["sparse-hit"]
    for mode, row in result["modes"].items():
        assert len(row["step_ms"]) == 3 and (mode == "dense" or row["disk_read_bytes_per_step"] > 0)
        assert len(row["round_median_step_ms"]) == 2  # two alternating rounds
    assert result["repeats"] == 2 and set(result["round_ratios"]) == {"dense", "sparse-hit", "sparse-naive"}
    assert all(len(ratios) == 2 and min(ratios) > 0 for ratios in result["round_ratios"].values())
    # No byte comparison here: the tiny model's 256-byte records put 16 tokens in a page, so a fifth of the
    # tokens touches most pages; the saving is measured on real models by the benchmark itself.
    assert offload["direct"] == sparse["direct"] and sparse["cold_bytes_fetched_per_step"] > 0
    assert sparse["io_backend"] in ("kernel-aio", "threads")
    assert set(sparse["breakdown_ms"]) == {"score", "fetch", "attention", "migrate", "rest"}
    assert 0 < sparse["cold_selection_rate"] < 1 and sparse["scorer_host_fallbacks"] == 0
    estimates = {name for name in result["recall"] if name != "edge_mass"}
    assert estimates == {f"{agg}-{bits}" for agg in ("sum", "max") for bits in ("fp", "int8", "int4")} | {
        "sum-int8 shortlist", "sum-int4 shortlist"} | {  # the path's own choice (no layer of two is predicted)
        f"{name} sum-int{bits} shortlist" for name in ("step-ahead", "step-ahead layers, own query,")
        for bits in (8, 4)}  # both layers asked for a step ahead
    assert all(0 <= result["recall"][name]["recall"] <= 1 for name in estimates)
    assert 0 < result["recall"]["edge_mass"]["recent=64"] <= result["recall"]["edge_mass"]["recent=256"] <= 1
    text = stem.with_suffix(".md").read_text()
    assert "x the decode speed of offload (median of 2 rounds" in text and "| sum-int8 |" in text
    assert "| sum-int4 shortlist |" in text and "a shortlist row is the sparse path's own choice" in text
    assert "| step-ahead sum-int4 shortlist |" in text and "the step-ahead rows are the first 2 tiered layers'" in text
    assert "score + fetch + migrate" in text and "2 alternating round(s)" in text
    assert "what removing all KV I/O gains on this machine" in text
    assert result["prefill"]["record_s"] > 0 and all(row["prefill_replayed"] for row in result["modes"].values())
    assert "the model prefilled the prompt once" in text  # every mode's cache was fed the recorded K/V
    planned = sparse["planned_selection_rates"]  # APP's estimate, shown beside the measured rates
    assert 0 <= planned["cold"] <= 1 and 0 <= planned["hot"] <= 1 and "selection rate hot / cold planned" in text
    sparse_threads = decode_threads("sparse")
    assert result["torch_threads"]["decode"]["sparse"] == sparse_threads and f"decode sparse {sparse_threads}" in text
    assert "sparse-hit" in capsys.readouterr().err  # progress bars name the run


def test_lookahead_both_runs_the_sparse_path_with_and_without_it(tiny_model_dir, tmp_path):
    assert _bench(tiny_model_dir, tmp_path, "--repeats", "1", "--policies", "hit", "--lookahead", "both",
                  "--skip-dense") == 0
    result = json.loads((tmp_path / "out" / f"sparse-{tiny_model_dir.name}-320-b2.json").read_text())
    assert set(result["modes"]) == {"offload", "sparse-hit", "sparse-hit-no-lookahead"}
    assert all(row["disk_read_bytes_per_step"] > 0 for row in result["modes"].values())
    # the tiny model's two layers are the two the lookahead skips: the rows count no predicted layer
    assert result["modes"]["sparse-hit"]["lookahead_layers_per_step"] == 0
    assert result["modes"]["sparse-hit-no-lookahead"]["lookahead_layers_per_step"] == 0
    for row in (result["modes"]["sparse-hit"], result["modes"]["sparse-hit-no-lookahead"]):
        assert row["unpredicted_fetch_ms"] == row["breakdown_ms"]["fetch"] > 0  # so all their fetch is unpredicted
    text = (tmp_path / "out" / f"sparse-{tiny_model_dir.name}-320-b2.md").read_text()
    assert text.count("0.0 layers per step took prefetched candidates, the others spent") == 2


def test_top_p_runs_the_adaptive_budget_beside_the_fixed_share_in_the_same_rounds(tiny_model_dir, tmp_path):
    assert _bench(tiny_model_dir, tmp_path, "--repeats", "2", "--policies", "hit", "--top-p", "0.9",
                  "--skip-dense") == 0
    result = json.loads((tmp_path / "out" / f"sparse-{tiny_model_dir.name}-320-b2.json").read_text())
    assert list(result["modes"]) == ["offload", "sparse-hit", "sparse-hit-top-p"] and result["top_p"] == 0.9
    for row in (result["modes"]["sparse-hit"], result["modes"]["sparse-hit-top-p"]):
        assert 0 < row["mass_kept"] <= 1 + 1e-6 and 0 < row["attended_share"] <= 1
    assert len(result["round_ratios"]["sparse-hit-top-p"]) == 2
    text = (tmp_path / "out" / f"sparse-{tiny_model_dir.name}-320-b2.md").read_text()
    assert "sparse-hit-top-p (top-p 0.9) vs sparse-hit (alpha 0.2): estimated mass kept" in text
    assert "x sparse-hit's (rounds " in text


def test_a_rerun_reads_the_recorded_prompt_back_from_the_document_store(tiny_model_dir, tmp_path):
    options = ("--repeats", "1", "--policies", "hit", "--skip-dense", "--skip-offload")
    stem = tmp_path / "out" / f"sparse-{tiny_model_dir.name}-320-b2"
    assert _bench(tiny_model_dir, tmp_path, *options) == 0
    assert json.loads(stem.with_suffix(".json").read_text())["prefill"]["rows_from_store"] == 0
    assert _bench(tiny_model_dir, tmp_path, *options) == 0
    prefill = json.loads(stem.with_suffix(".json").read_text())["prefill"]
    assert prefill["rows_from_store"] == 2 and prefill["bytes_from_store"] > 0
    assert "the prompt's K/V were read back from the document store" in stem.with_suffix(".md").read_text()
    assert _bench(tiny_model_dir, tmp_path, *options, "--no-kv-store") == 0
    assert json.loads(stem.with_suffix(".json").read_text())["prefill"]["rows_from_store"] == 0


def test_unwritable_results_directory_is_a_one_line_error(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "out").write_text("a file where the results directory should be")
    assert _bench(tiny_model_dir, tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvtier: error: results directory") and "Traceback" not in "\n".join(err)


def test_a_kv_store_that_is_a_file_is_a_one_line_error(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "store").write_text("a file where the store should be")
    assert _bench(tiny_model_dir, tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "KV store" in err[-1] and err[-1].startswith("kvtier: error:") and "Traceback" not in "\n".join(err)


def test_corpora_run_each_corpus_and_add_one_table(tiny_model_dir, tmp_path, capsys):
    assert _bench(tiny_model_dir, tmp_path, "--repeats", "1", "--policies", "hit", "--skip-dense",
                  "--corpora", "code,repetitive") == 0
    out = tmp_path / "out"
    for corpus in ("code", "repetitive"):  # each corpus's full result, the corpus ending its name
        assert json.loads((out / f"sparse-{tiny_model_dir.name}-320-b2-{corpus}.json").read_text())["corpus"] == corpus
    table = json.loads((out / f"sparse-corpora-{tiny_model_dir.name}-320-b2.json").read_text())
    assert table["corpora"] == ["code", "repetitive"] and set(table["runs"]) == {"code", "repetitive"}
    text = (out / f"sparse-corpora-{tiny_model_dir.name}-320-b2.md").read_text()
    assert all(f"| {corpus} | {mode} |" in text for corpus in ("code", "repetitive") for mode in ("offload", "sparse-hit"))
    assert "per-16-step medians" in capsys.readouterr().out


def test_an_unknown_corpus_in_corpora_is_named(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        _bench(tiny_model_dir, tmp_path, "--corpora", "code,dickens")
    assert "argument --corpora: 'code,dickens': give distinct names among" in capsys.readouterr().err
