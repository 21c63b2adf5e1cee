"""`kvtier bench generate` end to end on a tiny local model: real `kvtier generate` processes, result files, errors.

Mechanics only: no assertion here is about speed.
"""

import json

import pytest

from kvtier.cli import main


def test_real_generate_processes_per_corpus_and_mode(tiny_model_dir, tmp_path, capsys):
    rc = main(["bench", "generate", "--model", str(tiny_model_dir), "--context", "200", "--corpora", "repetitive",
               "--modes", "dense,offload", "--rounds", "1", "--max-new-tokens", "5", "--device-kv-budget", "32KiB",
               "--host-kv-budget", "32KiB", "--storage-dir", str(tmp_path / "kv"), "--kv-store",
               str(tmp_path / "store"), "--out", str(tmp_path / "out")])
    assert rc == 0
    result = json.loads((tmp_path / "out" / f"generate-corpora-{tiny_model_dir.name}-200.json").read_text())
    runs = result["corpora"]["repetitive"]["runs"]
    dense, offload = runs["dense"][0], runs["offload"][0]
    assert dense["reused_prompt_tokens"] > 0 and offload["reused_prompt_tokens"] > 0  # the stored document
    assert dense["prefill_tokens"] >= 200 and len(offload["step_ms"]) == offload["decode_tokens"] - 1
    assert offload["disk_bytes_read"] > 0 and dense["disk_bytes_read"] == 0
    assert offload["text"] == dense["text"]  # offload attends every token: the same answer
    assert "| repetitive | offload |" in capsys.readouterr().out


@pytest.mark.parametrize("option, value, message", [
    ("--corpora", "code,dickens", "argument --corpora: 'code,dickens': give distinct names"),
    ("--modes", "dense,dense", "argument --modes: 'dense,dense': give distinct KV modes"),
    ("--host-kv-budget", "lots", "argument --host-kv-budget: cannot parse size 'lots'"),
])
def test_bad_options_are_named_before_any_run(option, value, message, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "generate", option, value])
    assert message in capsys.readouterr().err


def test_a_round_count_below_one_is_a_one_line_error(tmp_path, capsys):
    assert main(["bench", "generate", "--rounds", "0", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "kvtier: error: --rounds must be at least 1, got 0"
