import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.commands.batch import read_requests
from kvtier.errors import ConfigError


def test_reads_prompts_with_per_line_overrides(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hi"}\n\n{"prompt": "Bye", "max_new_tokens": 5, "ignore_eos": true, "priority": 2}\n')
    requests = read_requests(path, default_max_new_tokens=32)
    assert [prompt for prompt, _ in requests] == ["Hi", "Bye"]
    assert [(s.max_new_tokens, s.ignore_eos, s.priority) for _, s in requests] == [(32, False, 0), (5, True, 2)]


@pytest.mark.parametrize("line, message", [
    ("not json", "prompts.jsonl:1: not JSON"),
    ('{"text": "Hi"}', 'prompts.jsonl:1: expected an object with a "prompt" string'),
    ('{"prompt": "Hi", "max_new_tokens": 0}', "prompts.jsonl:1: max_new_tokens must be an integer at least 1"),
    ('{"prompt": "Hi", "ignore_eos": "yes"}', "prompts.jsonl:1: ignore_eos must be true or false"),
])
def test_bad_lines_are_named(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message):
        read_requests(path, 8)


def test_an_empty_file_is_refused(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n")
    with pytest.raises(ConfigError, match="holds no prompts"):
        read_requests(path, 8)


HOLD_FLASH_FILE = """
import sys, time
sys.path.insert(0, sys.argv[2])
from swap_pools import filled_pool
from kvtier.engine.swap.flash import FlashSwap
swap = FlashSwap(filled_pool(), sys.argv[1], num_slots=64, model_id="served", io_threads=2)
swap.swap_out([0, 1]).wait()
print("ready", flush=True)
time.sleep(120)
"""


def test_batch_on_the_flash_file_of_a_running_process_is_refused_and_leaves_it_alone(tiny_model_dir, tmp_path):
    path = tmp_path / "kv" / "flash-served-64.kvc"  # as `kvtier serve` names its default file
    path.parent.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_FLASH_FILE, str(path), str(Path(__file__).parents[1])],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        before = hashlib.sha256(path.read_bytes()).hexdigest()
        # 64 MiB: another slot count, so it would have recreated the holder's file
        result = subprocess.run([sys.executable, "-m", "kvtier.cli", "batch", "--model", str(tiny_model_dir),
                                 "--file", str(_prompts(tmp_path, 1)), "--swap-space", "64MiB", "--flash-path",
                                 str(path)], capture_output=True, text=True, timeout=300)
        assert result.returncode == 2
        assert result.stderr == (f"kvtier: error: KV file {path} is in use by kvtier process {holder.pid}; stop it or "
                                 "give this run another path\n")  # one line: no progress bars either, not a terminal
        assert hashlib.sha256(path.read_bytes()).hexdigest() == before
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()


def test_a_finished_batch_deletes_its_flash_file(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "flash.kvc"
    assert main(["batch", "--model", str(tiny_model_dir), "--file", str(_prompts(tmp_path, 2)), "--max-new-tokens",
                 "3", "--swap-space", "4MiB", "--flash-path", str(path)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert not path.exists() and not (tmp_path / "flash.kvc.lock").exists()


def test_sigterm_stops_a_batch_and_deletes_its_flash_file(tiny_model_dir, tmp_path):
    path = tmp_path / "flash.kvc"
    process = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "batch", "--model", str(tiny_model_dir), "--file",
                                str(_prompts(tmp_path, 64)), "--max-new-tokens", "4000", "--swap-space", "4MiB",
                                "--flash-path", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.monotonic() + 300
    while not path.exists():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == -signal.SIGTERM and "Traceback" not in stderr
    assert not path.exists() and not (tmp_path / "flash.kvc.lock").exists()


def _prompts(directory: Path, count: int) -> Path:
    """`count` prompts that generate max_new_tokens each: a random model's greedy EOS depends on the machine's BLAS."""
    path = directory / "prompts.jsonl"
    path.write_text('{"prompt": "the sea light", "ignore_eos": true}\n' * count)
    return path
