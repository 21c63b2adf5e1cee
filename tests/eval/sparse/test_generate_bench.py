"""kvtier.eval.sparse.generate_bench: the runs a benchmark makes, in which order, and what each records (a fake
runner stands for the `kvtier generate` process; tests/commands/test_bench_generate.py runs the real one)."""

import pytest

from kvtier.eval.sparse import generate_bench
from kvtier.eval.sparse.generate_bench import (GenerateBench, GenerateRunError, run_generate_benchmark,
                                               subprocess_runner, write_documents)


def _bench(**changes) -> GenerateBench:
    settings = dict(model="m", dtype="float32", context=50, corpora=("code", "repetitive"),
                    modes=("dense", "offload", "sparse"), max_new_tokens=6, device_kv_budget="8MiB",
                    host_kv_budget="48MiB", rounds=2, first_steps=2, question="Why?", storage_dir="/kv",
                    kv_store="/store")
    return GenerateBench(**(settings | changes))


class FakeGenerate:
    """Answers every run with steps of `ms` per mode; remembers the argument lists."""

    ms = {"dense": 100.0, "offload": 300.0, "sparse": 120.0}

    def __init__(self):
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str]) -> dict:
        self.calls.append(argv)
        mode, tokens = argv[argv.index("--kv") + 1], int(argv[argv.index("--max-new-tokens") + 1])
        steps = [self.ms[mode] * 3] + [self.ms[mode]] * (tokens - 2)  # a slow first pass
        return {"ms_per_token": sum(steps) / len(steps), "step_ms": steps, "decode_tokens": tokens,
                "disk_bytes_read": 0 if mode == "dense" else int(self.ms[mode]) * 1000, "ttft_s": 1.5,
                "prefill_s": 1.0, "prefill_tokens": 60, "reused_prompt_tokens": 60, "text": f"answer {mode}",
                "process_s": 9.0}


def test_one_untimed_run_stores_each_document_then_modes_alternate_round_by_round(tmp_path):
    runner, dropped, lines = FakeGenerate(), [], []
    documents = {"code": tmp_path / "code.txt", "repetitive": tmp_path / "rep.txt"}
    result = run_generate_benchmark(_bench(), documents, runner, lambda: dropped.append(1) or True, lines.append)
    assert len(lines) == 12 and lines[-1] == "repetitive sparse round 2: 168.0 ms/token"
    modes = [argv[argv.index("--kv") + 1] for argv in runner.calls]
    assert modes == ["offload", "sparse", *["dense", "offload", "sparse"] * 2] * 2  # each tiered mode stores first
    assert all(argv[argv.index("--max-new-tokens") + 1] == "1" for argv in runner.calls[:2])
    assert len(dropped) == 12  # before every timed run
    assert all(argv[argv.index("--file") + 1] == str(documents["code"]) for argv in runner.calls[:8])
    dense_argv = runner.calls[2]
    assert "--device-kv-budget" not in dense_argv and dense_argv[-2:] == ["--kv-store", "/store"]
    sparse_argv = runner.calls[4]
    assert sparse_argv[sparse_argv.index("--host-kv-budget") + 1] == "48MiB" and "--json" in sparse_argv
    sparse = result["corpora"]["repetitive"]["runs"]["sparse"]
    assert len(sparse) == 2 and sparse[0]["first_steps_ms"] == 240.0 and sparse[0]["later_steps_ms"] == 120.0
    assert sparse[0]["page_cache_dropped"] and sparse[0]["text"] == "answer sparse"


def test_without_a_tiered_mode_dense_stores_the_document(tmp_path):
    runner = FakeGenerate()
    run_generate_benchmark(_bench(modes=("dense",), rounds=1, corpora=("code",)), {"code": tmp_path / "d"}, runner,
                           lambda: False)
    assert [argv[argv.index("--kv") + 1] for argv in runner.calls] == ["dense", "dense"]


def test_sparse_auto_runs_the_sparse_path_with_the_adaptive_budget_under_its_own_name(tmp_path):
    runner = FakeGenerate()
    result = run_generate_benchmark(_bench(modes=("sparse", "sparse-auto"), rounds=1, corpora=("code",)),
                                    {"code": tmp_path / "d"}, runner, lambda: False)
    alphas = [argv[argv.index("--alpha") + 1] if "--alpha" in argv else None for argv in runner.calls]
    assert [argv[argv.index("--kv") + 1] for argv in runner.calls] == ["sparse"] * 4
    assert alphas == [None, "auto", None, "auto"]  # each stores its own image first, then the timed runs
    assert list(result["corpora"]["code"]["runs"]) == ["sparse", "sparse-auto"]


def test_documents_are_cut_to_the_tokens_asked(tmp_path):
    class Words:  # a tokenizer of whitespace words
        def __call__(self, text):
            return {"input_ids": text.split()}

        def decode(self, ids):
            return " ".join(ids)

    documents = write_documents(Words(), ("repetitive", "code"), 30, tmp_path / "docs")
    assert set(documents) == {"repetitive", "code"}
    assert all(len(path.read_text().split()) == 30 for path in documents.values())


def test_a_failed_run_names_its_command_and_last_error_line(monkeypatch):
    monkeypatch.setattr(generate_bench.sys, "executable", "false")  # a process that fails at once
    with pytest.raises(GenerateRunError, match=r"`kvtier generate --model m \.\.\.` exited with 1: no message"):
        subprocess_runner(["generate", "--model", "m"])
