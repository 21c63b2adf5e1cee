"""The KV options every model command shares: the sparse mode's adaptive budget (`--alpha auto`, `--top-p`), parsed,
refused where it cannot work, and reported by `kvtier generate --json` on a tiny model."""

import argparse
import json

import pytest

from kvtier.cli import main
from kvtier.commands.kv_options import add_kv_options, kv_config_from
from kvtier.errors import ConfigError
from kvtier.sparse.mass import TopP
from kvtier.sparse.settings import DEFAULT_TOP_P

PROMPT = "what is the code of the blue lighthouse " * 20


def _config(*argv):
    parser = argparse.ArgumentParser()
    add_kv_options(parser)
    return kv_config_from(parser.parse_args(list(argv)))


def _generate(model_dir, tmp_path, *extra):
    return main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "8", "--json",
                 "--device-kv-budget", "64KiB", "--host-kv-budget", "48KiB", "--recent", "16",
                 "--storage-dir", str(tmp_path), *extra])


def test_alpha_auto_is_the_default_top_p_and_top_p_takes_a_mass():
    auto = _config("--kv", "sparse", "--alpha", "auto")
    assert auto.top_p == DEFAULT_TOP_P and TopP.of(auto.sparse_settings()).p == DEFAULT_TOP_P
    assert TopP.of(_config("--kv", "sparse", "--top-p", "0.8").sparse_settings()).p == 0.8
    assert TopP.of(_config("--kv", "sparse", "--alpha", "0.1").sparse_settings()) is None


def test_a_bad_budget_is_refused_naming_its_option():
    with pytest.raises(ConfigError, match="--top-p"):
        _config("--kv", "h2o", "--top-p", "0.9")
    with pytest.raises(ConfigError, match="--top-p"):
        _config("--kv", "sparse", "--top-p", "1.5")
    with pytest.raises(SystemExit):
        _config("--kv", "sparse", "--alpha", "most")


@pytest.mark.parametrize("budget", [["--alpha", "auto"], ["--top-p", "0.8"]])
def test_generate_reports_the_mass_the_adaptive_budget_kept(tiny_model_dir, tmp_path, capsys, budget):
    rc = _generate(tiny_model_dir, tmp_path, "--kv", "sparse", *budget)
    assert rc == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["attention_budget"]
    assert 0 < report["mass_kept_min"] <= report["mass_kept_mean"] <= 1 + 1e-6
    assert 0 < report["attended_share"] <= 1 and report["guard_events"] >= 0


def test_a_fixed_share_reports_its_mass_and_the_dense_mode_none(tiny_model_dir, tmp_path, capsys):
    assert _generate(tiny_model_dir, tmp_path, "--kv", "sparse", "--alpha", "0.2") == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["attention_budget"]
    assert 0 < report["mass_kept_mean"] <= 1 + 1e-6 and report["guard_events"] == 0
    assert report["attended_share"] == pytest.approx(0.2, abs=0.02)
    assert _generate(tiny_model_dir, tmp_path) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["attention_budget"] is None
