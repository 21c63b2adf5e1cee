"""The `kvtier` entry point: lazy command loading, help, unknown commands, pipes closed early, SIGTERM."""

import signal
import subprocess
import sys

import pytest

from kvtier.cli import BENCH_COMMANDS, COMMANDS, build_parser, main


def _imports_after(args: list[str], status: int = 0) -> set[str]:
    """Heavy modules a fresh interpreter has loaded after running `kvtier ARGS` (a subprocess: this one has torch),
    which must end with `status` (--help and argparse's errors end in SystemExit)."""
    code = ("import sys\nfrom kvtier.cli import main\ntry:\n    rc = main(sys.argv[1:])\nexcept SystemExit as end:\n"
            "    rc = end.code\nprint(sorted(name for name in ('torch', 'transformers') if name in sys.modules))\n"
            "sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == status, done.stderr
    return set(eval(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("args", [["models"], ["-v", "models", "list"], ["cost", "--writes-per-day", "1TiB"]])
def test_light_commands_do_not_import_torch_or_transformers(args):
    assert _imports_after(args) == set()


def test_store_list_does_not_import_torch_or_transformers(tmp_path):
    assert _imports_after(["store", "list", "--kv-store", str(tmp_path / "store")]) == set()


def test_no_command_module_imports_torch_or_transformers():
    """Every module of kvtier.commands (the parsers, their shared options) imports neither: they leave them to `run`."""
    code = ("import importlib, pkgutil, sys\nimport kvtier.commands as commands\n"
            "for module in pkgutil.iter_modules(commands.__path__):\n"
            "    importlib.import_module(f'kvtier.commands.{module.name}')\n"
            "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("args", [["--help"], ["bench", "--help"], ["generate", "--help"], ["serve", "--help"],
                                  ["batch", "--help"], ["demo", "--help"],
                                  *(["bench", name, "--help"] for name in BENCH_COMMANDS)])
def test_help_is_given_before_torch_is_imported(args):
    assert _imports_after(args) == set()


@pytest.mark.parametrize("args", [["generate", "--prompt", "x", "--alpha", "0"], ["generate", "--no-such-option"],
                                  ["demo", "--beta", "-1"], ["serve", "--port", "70000"],
                                  ["batch", "--file", "prompts.jsonl", "--swap", "tape"],
                                  ["batch", "--file", "missing.jsonl", "--block-tokens", "8"],
                                  ["bench", "sparse", "--score-bits", "3"], ["bench", "serve", "--load-format", "fast"],
                                  ["bench", "http", "--clients", "many"], ["bench", "store", "--kv", "paged"],
                                  ["bench", "accuracy", "--depths", "2"], ["bench", "latency", "--experiments", "z"],
                                  ["bench", "report", "--no-such-option"], ["bench", "vllm-tier", "--models", "gpt-17"]])
def test_an_argument_error_is_reported_before_torch_is_imported(args):
    assert _imports_after(args, status=2) == set()


def test_a_named_command_builds_only_its_own_parser():
    parser = build_parser(["bench", "report", "--out", "x"])
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == set(COMMANDS) | {"bench"}  # listed, by their summaries
    bench = commands["bench"]._subparsers._group_actions[0].choices
    assert "--results" in bench["report"]._option_string_actions
    assert "--model" not in bench["sparse"]._option_string_actions
    assert "--model" not in commands["generate"]._option_string_actions


def test_help_and_unknown_commands_see_every_command(capsys):
    commands = build_parser([])._subparsers._group_actions[0].choices
    assert set(commands) == set(COMMANDS) | {"bench"}
    assert set(commands["bench"]._subparsers._group_actions[0].choices) == set(BENCH_COMMANDS)
    with pytest.raises(SystemExit) as exit_info:
        main(["no-such-command"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "invalid choice: 'no-such-command'" in error and "generate" in error and "bench" in error


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """`kvtier cost --json | head -1`: the pipe closes before the report is written."""
    process = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "cost", "--json"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # the reader is gone before the command writes
    stderr = process.stderr.read()
    assert process.wait(timeout=300) == 128 + signal.SIGPIPE
    assert stderr == ""
