"""The `kvtier` entry point: lazy command loading, help, unknown commands."""

import subprocess
import sys

import pytest

from kvtier.cli import BENCH_COMMANDS, COMMANDS, build_parser, main


def _imports_after(args: list[str]) -> set[str]:
    """Heavy modules a fresh interpreter has loaded after running `kvtier ARGS` (a subprocess: this one has torch)."""
    code = ("import sys; from kvtier.cli import main; rc = main(sys.argv[1:]); "
            "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules)); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return set(eval(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("args", [["models"], ["-v", "models", "list"], ["cost", "--writes-per-day", "1TiB"]])
def test_light_commands_do_not_import_torch_or_transformers(args):
    assert _imports_after(args) == set()


def test_store_list_does_not_import_torch_or_transformers(tmp_path):
    assert _imports_after(["store", "list", "--kv-store", str(tmp_path / "store")]) == set()


def test_a_named_command_builds_only_its_own_parser():
    parser = build_parser(["bench", "report", "--out", "x"])
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == {"bench"}
    assert set(commands["bench"]._subparsers._group_actions[0].choices) == {"report"}


def test_help_and_unknown_commands_see_every_command(capsys):
    commands = build_parser([])._subparsers._group_actions[0].choices
    assert set(commands) == set(COMMANDS) | {"bench"}
    assert set(commands["bench"]._subparsers._group_actions[0].choices) == set(BENCH_COMMANDS)
    with pytest.raises(SystemExit) as exit_info:
        main(["no-such-command"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "invalid choice: 'no-such-command'" in error and "generate" in error and "bench" in error
