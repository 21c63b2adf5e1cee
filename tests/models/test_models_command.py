"""`kvtier models` through the real CLI entry point (kvtier.cli.main), on fake models."""

import pytest

from kvtier import cli
from kvtier.commands import models as models_command


@pytest.fixture
def two_fakes(make_fake, monkeypatch):
    installed = make_fake("fake-here", [2048, 1024])
    absent = make_fake("fake-away", [10], installed=False)
    monkeypatch.setattr(models_command, "REGISTRY", {spec.name: spec for spec in (installed.spec, absent.spec)})
    return installed, absent


def test_list_shows_size_context_and_install_state(two_fakes, cache, capsys):
    assert cli.main(["models", "pull", "fake-here", "--quiet"]) == 0
    path = capsys.readouterr().out.strip()
    assert path == str(cache / "models" / "fake-here.gguf")
    assert cli.main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "CONTEXT", "INSTALLED", "PATH"]
    assert lines[1].split() == ["fake-here", "3.0KiB", "1K", "yes", path]
    assert lines[2].split() == ["fake-away", "10B", "1K", "no", "-"]
    assert lines[3] == "Install one with: kvtier models pull NAME"


def test_list_is_the_default_action(two_fakes, capsys):
    assert cli.main(["models", "list"]) == 0
    listed = capsys.readouterr().out
    assert cli.main(["models"]) == 0
    assert capsys.readouterr().out == listed


def test_pull_reports_progress_and_path(two_fakes, cache, capsys):
    assert cli.main(["models", "pull", "fake-here"]) == 0
    out = capsys.readouterr().out
    assert "Assembling fake-here from 2 parts" in out
    assert f"fake-here: ready at {cache / 'models' / 'fake-here.gguf'}" in out


def test_pull_unknown_model_is_one_line_error(capsys):
    assert cli.main(["models", "pull", "llama-70b"]) == 2
    err = capsys.readouterr().err
    assert err == "kvtier: error: unknown model 'llama-70b': known models are gemma3-270m, qwen2.5-0.5b, smollm2-135m\n"
