"""`kvtier generate` end to end on a tiny local model: JSON output, and one-line errors for bad input."""

import json
import os
import subprocess
import sys

import pytest

from kvtier.cli import main

PROMPT = "what is the code of the blue lighthouse " * 20


def _generate(model_dir, *extra):
    return main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "8", *extra])


def _one_line_error(capsys, rc) -> str:
    """The error is one line, the last on stderr (progress bars may come before it), with no traceback."""
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0] == err.strip().splitlines()[-1], err
    assert errors[0].startswith("kvtier: error: ")
    return errors[0]


def test_json_is_the_last_stdout_line_and_offload_reads_disk(tiny_model_dir, tmp_path, capsys):
    rc = _generate(tiny_model_dir, "--kv", "offload", "--device-kv-budget", "8KiB", "--host-kv-budget", "0",
                   "--block-tokens", "16", "--storage-dir", str(tmp_path), "--json")
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for field in ("text", "prefill_tokens", "decode_tokens", "prefill_s", "decode_s", "ms_per_token",
                  "disk_bytes_read", "disk_bytes_written", "kv_bytes"):
        assert field in result
    assert result["prefill_tokens"] == 160 and result["decode_tokens"] >= 1
    assert result["disk_bytes_read"] > 0 and result["disk_bytes_written"] > 0
    assert set(result["kv_bytes"]) == {"device", "host", "storage"} and result["kv_bytes"]["storage"] > 0
    assert not list(tmp_path.iterdir())  # the KV file is scratch: removed at the end
    steps = result["step_ms"]  # each decode forward pass after the first token, timed
    assert len(steps) == result["decode_tokens"] - 1 and all(ms > 0 for ms in steps)
    assert sum(steps) <= result["decode_s"] * 1000 * 1.01


def test_token_clock_times_the_passes_between_the_last_tokens():
    from kvtier.commands.generate import TokenClock

    clock = TokenClock()
    assert clock.step_ms(0) == [] and clock("cache") is False
    clock.times = [1.0, 2.0, 2.5, 2.75]  # a prefill chunk, then three tokens chosen
    assert clock.step_ms(3) == [500.0, 250.0] and clock.step_ms(1) == []


def test_offload_text_equals_dense_text(tiny_model_dir, tmp_path, capsys):
    _generate(tiny_model_dir, "--json")
    dense = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    _generate(tiny_model_dir, "--json", "--kv", "offload", "--device-kv-budget", "8KiB", "--block-tokens", "16",
              "--host-kv-budget", "8KiB", "--storage-dir", str(tmp_path))
    offload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert offload["token_ids"] == dense["token_ids"]


def test_bfloat16_halves_the_kv_bytes_and_offload_still_equals_dense(tiny_model_dir, tmp_path, capsys):
    runs = {}
    for name, extra in {"fp32": (), "bf16": ("--dtype", "bfloat16"),
                        "bf16-offload": ("--dtype", "bfloat16", "--kv", "offload", "--device-kv-budget", "8KiB",
                                         "--block-tokens", "16", "--host-kv-budget", "0",
                                         "--storage-dir", str(tmp_path))}.items():
        assert _generate(tiny_model_dir, "--json", *extra) == 0
        runs[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sum(runs["bf16"]["kv_bytes"].values()) * 2 == sum(runs["fp32"]["kv_bytes"].values())
    assert runs["bf16-offload"]["token_ids"] == runs["bf16"]["token_ids"]
    assert runs["bf16-offload"]["disk_bytes_read"] > 0


@pytest.mark.parametrize("mode", ["sparse", "h2o", "infinigen", "leoam"])
def test_selective_modes_run_in_bfloat16_and_read_their_disk_tier(tiny_model_dir, tmp_path, capsys, mode):
    rc = _generate(tiny_model_dir, "--json", "--dtype", "bfloat16", "--kv", mode, "--device-kv-budget", "24KiB",
                   "--host-kv-budget", "24KiB", "--block-tokens", "16", "--storage-dir", str(tmp_path))
    assert rc == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["decode_tokens"] >= 1 and result["disk_bytes_read"] > 0 and result["kv_bytes"]["storage"] > 0


def test_unknown_model(capsys):
    rc = main(["generate", "--model", "no-such-model", "--prompt", "hi"])
    assert "no-such-model" in _one_line_error(capsys, rc)


def test_missing_input_file(tmp_path, capsys):
    rc = main(["generate", "--file", str(tmp_path / "missing.txt")])
    assert "missing.txt" in _one_line_error(capsys, rc)


def test_empty_input_file(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    rc = main(["generate", "--file", str(empty)])
    assert "empty.txt is empty" in _one_line_error(capsys, rc)


def test_storage_dir_missing(tiny_model_dir, tmp_path, capsys):
    rc = _generate(tiny_model_dir, "--kv", "offload", "--storage-dir", str(tmp_path / "no" / "nope"))
    assert "does not exist" in _one_line_error(capsys, rc)


def test_storage_dir_is_created_when_its_parent_exists(tiny_model_dir, tmp_path, capsys):
    rc = _generate(tiny_model_dir, "--kv", "offload", "--storage-dir", str(tmp_path / "new"))
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "new").is_dir() and not list((tmp_path / "new").iterdir())


def test_budget_smaller_than_one_block(tiny_model_dir, tmp_path, capsys):
    rc = _generate(tiny_model_dir, "--kv", "offload", "--device-kv-budget", "1KiB", "--storage-dir", str(tmp_path))
    assert "smaller than one KV block" in _one_line_error(capsys, rc)
    assert not list(tmp_path.iterdir())


def test_unparsable_budget(tiny_model_dir, capsys):
    rc = _generate(tiny_model_dir, "--kv", "offload", "--device-kv-budget", "12 parsecs")
    assert "cannot parse size" in _one_line_error(capsys, rc)


def test_prompt_longer_than_context(tiny_model_dir, capsys):
    rc = _generate(tiny_model_dir, "--max-new-tokens", "9000")
    assert "exceeds the 8192-token context" in _one_line_error(capsys, rc)


@pytest.fixture
def full_dir(tmp_path):
    """A 1 MiB tmpfs: any KV file bigger than that hits ENOSPC at preallocation."""
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_full_storage_dir(tiny_model_dir, full_dir, capsys):
    # 4,000 new tokens x 2 layers x K+V x 512 B/token is ~8 MiB of KV file: more than the 1 MiB disk.
    rc = main(["generate", "--model", str(tiny_model_dir), "--prompt", PROMPT, "--max-new-tokens", "4000",
               "--kv", "offload", "--storage-dir", str(full_dir)])
    assert "not enough space" in _one_line_error(capsys, rc)
    assert not list(full_dir.iterdir())


def test_errors_reach_the_shell_without_traceback(tmp_path):
    env = {**os.environ, "KVTIER_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", "generate", "--model", "no-such-model", "--prompt", "hi"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and done.stderr.startswith("kvtier: error:")


def test_a_file_in_another_encoding_is_named_with_the_option_that_reads_it(tiny_model_dir, tmp_path, capsys):
    document = tmp_path / "latin.txt"
    document.write_bytes("the café of the blue lighthouse ".encode("latin-1") * 10)
    rc = main(["generate", "--model", str(tiny_model_dir), "--file", str(document), "--max-new-tokens", "2"])
    assert _one_line_error(capsys, rc) == (f"kvtier: error: input file {document} is not utf-8 text (byte 0xe9 at "
                                           "offset 7); give its encoding, e.g. --encoding latin-1")
    assert main(["generate", "--model", str(tiny_model_dir), "--file", str(document), "--max-new-tokens", "2",
                 "--encoding", "latin-1"]) == 0
    rc = main(["generate", "--file", str(document), "--encoding", "klingon"])
    assert _one_line_error(capsys, rc).startswith("kvtier: error: --encoding klingon: unknown text encoding")


def test_budgets_given_to_dense_are_ignored_with_one_warning(tiny_model_dir, capsys, caplog):
    assert _generate(tiny_model_dir, "--device-kv-budget", "1KiB", "--host-kv-budget", "1KiB", "--no-kv-store") == 0
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert warnings == ["--kv dense keeps all the KV on the device: --device-kv-budget and --host-kv-budget ignored; "
                        "choose a tiered mode (--kv offload, sparse, ...) to bound it"]
    caplog.clear()
    assert _generate(tiny_model_dir, "--no-kv-store") == 0
    assert not [record for record in caplog.records if record.levelname == "WARNING"]


def test_progress_bars_only_on_a_terminal_or_when_asked(tiny_model_dir, tmp_path):
    """stderr here is a pipe, as in a log: the summary line alone, unless --progress asks for the bars."""
    command = [sys.executable, "-m", "kvtier.cli", "generate", "--model", str(tiny_model_dir), "--prompt", PROMPT,
               "--max-new-tokens", "2", "--no-kv-store"]
    env = {**os.environ, "KVTIER_CACHE_DIR": str(tmp_path)}
    quiet = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert quiet.returncode == 0 and len(quiet.stderr.splitlines()) == 1, quiet.stderr
    assert quiet.stderr.startswith("[dense] prefill 160 tok")
    shown = subprocess.run([*command[:3], "--progress", *command[3:]], capture_output=True, text=True, env=env,
                           timeout=600)
    assert shown.returncode == 0 and "prefill:" in shown.stderr and "Loading weights" in shown.stderr
