"""`kvtier bench http` end to end on a tiny local model: every (backend, clients) cell is measured and written.

Mechanics only: no assertion here is about speed.
"""

import json
import statistics

from kvtier.cli import main


def bench_http(model_dir, tmp_path, *options: str):
    """`kvtier bench http` with `options` on the model in `model_dir`, files under `tmp_path`; its results folder."""
    out = tmp_path / "out"
    assert main(["bench", "http", "--model", str(model_dir), *options, "--flash-dir", str(tmp_path / "flash"),
                 "--out", str(out)]) == 0
    return out


def test_writes_a_cell_per_backend_and_client_count(tiny_model_dir, tmp_path):
    out = bench_http(tiny_model_dir, tmp_path, "--clients", "1,4", "--repeats", "2", "--new-tokens", "20",
                     "--min-requests", "2", "--device-blocks", "3", "--swap-space", "4MiB")
    result = json.loads((out / "http.json").read_text())
    cells = {(cell["setup"], cell["clients"]): cell for cell in result["cells"]}
    assert set(cells) == {(f"{backend} swap", clients) for backend in ("flash", "dram") for clients in (1, 4)}
    assert result["requests"] == {"1": 2, "4": 4}
    for cell in cells.values():
        assert len(cell["runs"]) == 2
        ratios = [run["ratio"] for run in cell["runs"]]
        assert cell["ratio"] == statistics.median(ratios) and cell["ratio_spread"] == [min(ratios), max(ratios)]
        assert 0 < cell["ttft_p50_s"] <= cell["ttft_p99_s"] and 0 < cell["itl_p50_s"] <= cell["itl_p99_s"]
    assert cells[("flash swap", 4)]["swap_outs"] > 0  # three blocks of 16 tokens cannot hold four growing sequences
    markdown = (out / "http.md").read_text()
    assert "## flash swap" in markdown and "## dram swap" in markdown and "| 4 |" in markdown


def test_the_random_workload_compares_step_budgets_and_reports_the_tails(tiny_model_dir, tmp_path):
    out = bench_http(tiny_model_dir, tmp_path, "--workload", "random", "--clients", "3", "--min-requests", "4",
                     "--new-tokens", "6", "--repeats", "1", "--max-batched-tokens", "400,64", "--device-kv-budget",
                     "1MiB", "--swap-space", "4MiB")
    result = json.loads((out / "http-random.json").read_text())
    assert {name: setup["max_batched_tokens"] for name, setup in result["setups"].items()} == {
        "400 tokens per step": 400, "64 tokens per step": 64}
    assert result["command"].startswith("kvtier bench http --workload random") and result["prompt_tokens"] == 384
    for cell in result["cells"]:
        assert cell["clients"] == 3 and cell["ttft_tail"] >= 1 and cell["itl_tail"] >= 1
    assert "| TTFT tail |" in (out / "http-random.md").read_text()


def test_random_prompts_are_the_asked_length_and_the_same_every_run(tiny_model_dir):
    from transformers import AutoTokenizer

    from kvtier.commands.bench_http import random_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = random_prompts(tokenizer, 3, 50)
    assert texts == random_prompts(tokenizer, 3, 50) and len(set(texts)) == 3
    assert all(len(tokenizer(text)["input_ids"]) == 50 for text in texts)


def test_the_documents_workload_runs_four_servers_and_short_requests_beside_tiered_ones(tiny_model_dir, tmp_path):
    out = bench_http(tiny_model_dir, tmp_path, "--workload", "documents", "--documents", "2", "--document-tokens",
                     "1500", "--new-tokens", "12", "--repeats", "1", "--device-kv-budget", "512KiB",
                     "--host-kv-budget", "2MiB", "--max-tiered-seqs", "2", "--tiered-slice", "4",
                     "--swap-space", "8MiB")
    result = json.loads((out / "http-documents.json").read_text())
    assert set(result["servers"]) == {"tiered", "sliced", "serial", "paged"} and result["questions"] == 4
    [sliced], [tiered] = result["servers"]["sliced"]["runs"], result["servers"]["tiered"]["runs"]
    assert sliced["set_asides"] >= 2 and sliced["set_aside_bytes"] > 0 and tiered["set_asides"] == 0
    assert all(server["same_answers"] <= 4 and server["tokens_per_s"] > 0 for server in result["servers"].values())
    mixed = result["mixed"]
    assert mixed["tiered"] == 2 and mixed["short_requests"] == 8  # both long questions ran as tiered sequences
    assert 1 <= mixed["tiered_decoding"] <= 2  # a long one may finish its twelve tokens before the short ones go
    assert mixed["idle_ttft_p50_s"] > 0 and mixed["busy_ttft_p50_s"] > 0
    assert "Mixed traffic" in (out / "http-documents.md").read_text()


def test_sampling_fields_compare_plain_and_processed_sampling_in_one_run(tiny_model_dir, tmp_path):
    fields = '{"repetition_penalty": 1.1, "top_k": 5, "min_p": 0.05}'
    out = bench_http(tiny_model_dir, tmp_path, "--clients", "1,3", "--repeats", "2", "--new-tokens", "6",
                     "--min-requests", "3", "--device-blocks", "8", "--sampling-fields", fields)
    result = json.loads((out / "http-sampling.json").read_text())
    plain, processed = "temperature 1", "temperature 1 + repetition_penalty, top_k, min_p"
    assert result["request_fields"] == {plain: {"temperature": 1.0},
                                        processed: {"temperature": 1.0} | json.loads(fields)}
    assert {setup["swap"] for setup in result["setups"].values()} == {"flash"}
    assert {(cell["setup"], cell["clients"]) for cell in result["cells"]} == {
        (name, clients) for name in (plain, processed) for clients in (1, 3)}
    assert f"## {processed} / {plain}" in (out / "http-sampling.md").read_text()
    assert result["command"].endswith(f"--sampling-fields '{fields}'")


def test_sampling_fields_are_checked_before_the_model_loads(tmp_path, capsys):
    for fields, problem in (('{"top_k": -5}', "top_k"), ("{nope", "not JSON"), ('{"colour": 1}', "only sampling")):
        assert main(["bench", "http", "--model", "no-such-model", "--sampling-fields", fields,
                     "--out", str(tmp_path)]) == 2
        assert problem in capsys.readouterr().err
