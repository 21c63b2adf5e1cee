"""`kvtier cost` through its own argparse parser: text and JSON reports, measured input, errors."""

import argparse
import json

import pytest

from kvtier.commands import cost
from kvtier.errors import ConfigError
from kvtier.eval.serving.costmodel import GIB, TB


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtier")
    cost.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["cost", *argv])


def _report(argv: list[str], capsys) -> dict:
    args = _parse([*argv, "--json"])
    assert args.run(args) == 0
    return json.loads(capsys.readouterr().out)


def test_default_text_report_shows_table12_totals(capsys):
    assert cost.run(_parse([])) == 0
    out = capsys.readouterr().out
    assert "$729.00" in out
    assert "$120.00" in out
    assert "DRAM / HiFC: 6.08x" in out
    assert "8.11 years at 1.98 TiB/day" in out
    assert "Pipeline" not in out


def test_json_report_in_paper_decimal_units(capsys):
    report = _report(["--pslc-size", "200GB", "--writes-per-day", "1.98TB"], capsys)
    endurance = report["endurance"]
    assert endurance["tbw_bytes"] == 6_000 * TB
    assert endurance["gain_over_rating"] == pytest.approx(8.0)
    assert endurance["lifetime_years"] == pytest.approx(8.30, abs=0.005)
    assert endurance["bytes_per_day_source"] == "--writes-per-day"
    totals = [tier["total"] for tier in report["cost"]["tiers"]]
    assert totals == pytest.approx([729.0, 120.0], abs=0.02)
    assert "pipeline" not in report


def test_cost_options_change_the_numbers(capsys):
    report = _report(
        ["--years", "1", "--pue", "1.0", "--energy-price", "0.1", "--dram-size", "64GiB", "--dram-price", "4",
         "--dram-power", "10", "--flash-size", "2TiB", "--flash-price", "0.05", "--flash-power", "0"],
        capsys,
    )
    dram, flash = report["cost"]["tiers"]
    assert dram["capex"] == pytest.approx(256.0)
    assert dram["opex"] == pytest.approx(8.76)  # 10 W x 8760 h x $0.10/kWh
    assert flash["total"] == pytest.approx(102.4)
    assert report["cost"]["dram_to_flash_ratio"] == pytest.approx(264.76 / 102.4)


def test_measured_file_sets_writes_per_day(tmp_path, capsys):
    measured = tmp_path / "serve.json"
    measured.write_text(json.dumps({"swap_out_bytes": GIB, "wall_s": 3600, "tokens": 5}))
    endurance = _report(["--measured", str(measured), "--waf", "1.02"], capsys)["endurance"]
    assert endurance["bytes_per_day"] == pytest.approx(24 * GIB)
    assert endurance["lifetime_years"] == pytest.approx(30_000 * 200 * GIB / (24 * GIB * 1.02 * 365))
    assert str(measured) in endurance["bytes_per_day_source"]


def test_measured_run_without_swaps_has_unbounded_lifetime(tmp_path, capsys):
    measured = tmp_path / "serve.json"
    measured.write_text(json.dumps({"swap_out_bytes": 0, "wall_s": 60.0}))
    assert _report(["--measured", str(measured)], capsys)["endurance"]["lifetime_years"] is None
    cost.run(_parse(["--measured", str(measured)]))
    assert "Lifetime: unbounded" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ("{not json", "is not JSON"),
        (json.dumps({"swap_out_bytes": 10}), "lacks numeric"),
        (json.dumps([1, 2]), "lacks numeric"),
        (json.dumps({"swap_out_bytes": 10, "wall_s": 0}), "wall_s must be positive"),
    ],
)
def test_bad_measured_file_names_the_file(tmp_path, content, message):
    measured = tmp_path / "serve.json"
    if content is not None:
        measured.write_text(content)
    with pytest.raises(ConfigError, match=message) as error:
        cost.run(_parse(["--measured", str(measured)]))
    assert str(measured) in str(error.value)


def test_pipeline_budget_when_all_inputs_given(capsys):
    argv = ["--tps-ideal", "100", "--tps-test", "90", "--t-lat", "0.207", "--n-swap", "10", "--block-tokens", "64",
            "--token-bytes", "256KiB", "--flash-bw", "4GiB", "--t-fix", "0.1"]
    pipeline = _report(argv, capsys)["pipeline"]
    assert pipeline["t_gap_s"] == pytest.approx(2.07)
    assert pipeline["t_swap_s"] == pytest.approx(0.1390625)
    assert pipeline["swap_hidden"] is True
    cost.run(_parse(argv))
    assert "Pipeline budget: T_gap 2.070 s, T_swap 0.139 s, swap hidden" in capsys.readouterr().out


def test_pipeline_half_is_reported_alone(capsys):
    pipeline = _report(["--tps-ideal", "100", "--tps-test", "50", "--t-lat", "0.01"], capsys)["pipeline"]
    assert pipeline == {"t_gap_s": pytest.approx(0.5)}


def test_partial_pipeline_inputs_name_the_missing_options():
    with pytest.raises(ConfigError, match="--t-lat"):
        cost.run(_parse(["--tps-ideal", "100", "--tps-test", "90"]))


@pytest.mark.parametrize(
    "argv",
    [["--dram-size", "12 bananas"], ["--writes-per-day", "1TiB", "--measured", "x.json"]],
)
def test_argparse_rejects_bad_options(argv, capsys):
    with pytest.raises(SystemExit):
        _parse(argv)
    assert "--" in capsys.readouterr().err


def test_invalid_model_input_raises_config_error():
    with pytest.raises(ConfigError, match="PUE"):
        cost.run(_parse(["--pue", "0.5"]))


@pytest.mark.parametrize("argv, message", [(["--years", "0"], "--years must be positive, got 0.0"),
                                           (["--pslc-size", "0"], "--pslc-size must be positive, got 0"),
                                           (["--flash-price", "-1"], "--flash-price must not be negative, got -1.0")])
def test_an_option_out_of_range_is_named(argv, message):
    with pytest.raises(ConfigError) as error:
        cost.run(_parse(argv))
    assert str(error.value) == message
