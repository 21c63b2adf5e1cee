"""`kvtier cost`: HiFC's memory-expansion cost, flash endurance and pipeline budget, from options.

Every input of `kvtier.eval.serving.costmodel` is an option whose default is that module's value (the
paper's numbers, or our documented assumptions). `--measured FILE.json` reads the
{"swap_out_bytes": N, "wall_s": S} that the serve benchmark writes, to turn a real run into
writes per day and a lifetime. `--json` prints the same report as one JSON object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.eval.serving.costmodel import (
    PAPER_DRAM,
    PAPER_HIFC,
    PAPER_KV_WRITES_PER_DAY,
    TB,
    TIB,
    FlashEndurance,
    MemoryTier,
    Operation,
    TierCost,
    compare_costs,
    gap_budget_s,
    swap_hidden,
    swap_time_s,
    writes_per_day,
)
from kvtier.units import format_size, parse_size

_DEFAULT_OPERATION = Operation()
_DEFAULT_ENDURANCE = FlashEndurance()
# Each half of the pipeline budget is computed only when all of its options are given.
_GAP_OPTIONS = ("tps_ideal", "tps_test", "t_lat")
_SWAP_OPTIONS = ("n_swap", "block_tokens", "token_bytes", "flash_bw")
# Checked here, where the option's name is known (the models' own checks name their fields).
_POSITIVE = ("years", "dram_size", "flash_size", "pe_cycles", "pslc_size", "rated_tbw")
_NON_NEGATIVE = ("energy_price", "dram_price", "flash_price", "dram_power", "flash_power")


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "cost",
        description="HiFC's memory-expansion cost (DRAM vs flash), pSLC endurance and lifetime, "
        "and the swap pipeline budget. Every input is an option; defaults are the paper's numbers "
        "or the assumptions documented in kvtier.eval.serving.costmodel.",
    )
    cost = parser.add_argument_group(
        "cost", "defaults: prices and sizes from the paper's Table 12; power, PUE and energy price are our assumptions"
    )
    cost.add_argument("--years", type=float, default=_DEFAULT_OPERATION.years,
                      help="service life (default %(default)s)")
    cost.add_argument("--pue", type=float, default=_DEFAULT_OPERATION.pue, help="data-centre PUE (default %(default)s)")
    cost.add_argument("--energy-price", type=float, default=_DEFAULT_OPERATION.energy_cost_per_kwh,
                      help="USD per kWh (default %(default)s)")
    for prefix, tier in (("dram", PAPER_DRAM), ("flash", PAPER_HIFC)):
        cost.add_argument(f"--{prefix}-size", type=_size_arg, default=tier.capacity_bytes,
                          help=f"{tier.name} capacity (default {format_size(tier.capacity_bytes)})")
        cost.add_argument(f"--{prefix}-price", type=float, default=tier.price_per_gib,
                          help=f"{tier.name} USD per GiB (default %(default)s)")
        cost.add_argument(f"--{prefix}-power", type=float, default=tier.power_w,
                          help=f"{tier.name} average power in W (default %(default)s)")

    endurance = parser.add_argument_group("endurance")
    endurance.add_argument("--pe-cycles", type=int, default=_DEFAULT_ENDURANCE.pe_cycles,
                           help="pSLC program/erase cycles (default %(default)s)")
    endurance.add_argument("--pslc-size", type=_size_arg, default=_DEFAULT_ENDURANCE.region_bytes,
                           help=f"pSLC region (default {format_size(_DEFAULT_ENDURANCE.region_bytes)})")
    endurance.add_argument("--rated-tbw", type=_size_arg, default=_DEFAULT_ENDURANCE.rated_tbw_bytes,
                           help="the drive's TLC write rating (default 750TB)")
    endurance.add_argument("--waf", type=float, default=1.0, help="write amplification (default %(default)s)")
    writes = endurance.add_mutually_exclusive_group()
    writes.add_argument("--writes-per-day", type=_size_arg,
                        help="KV bytes swapped out per day (default: the paper's 1.98TiB)")
    writes.add_argument("--measured", metavar="FILE.json",
                        help='serve benchmark result with {"swap_out_bytes": N, "wall_s": S}')

    pipeline = parser.add_argument_group("pipeline budget", "T_gap needs the first three, T_swap the next four")
    pipeline.add_argument("--tps-ideal", type=float, help="ideal tokens per second")
    pipeline.add_argument("--tps-test", type=float, help="measured tokens per second")
    pipeline.add_argument("--t-lat", type=float, help="per-token pipeline latency in seconds")
    pipeline.add_argument("--n-swap", type=int, help="blocks moved by one swap")
    pipeline.add_argument("--block-tokens", type=int, help="tokens per KV block")
    pipeline.add_argument("--token-bytes", type=_size_arg, help="KV bytes per token, all layers")
    pipeline.add_argument("--flash-bw", type=_size_arg, help="flash bandwidth per second, e.g. 4.7GiB")
    pipeline.add_argument("--t-fix", type=float, default=0.0, help="fixed cost of one swap in seconds (default 0)")

    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    _check_ranges(args)
    report = {"cost": _cost_report(args), "endurance": _endurance_report(args)}
    pipeline = _pipeline_report(args)
    if pipeline:
        report["pipeline"] = pipeline
    print(json.dumps(report, indent=2) if args.json else _render(report))
    return 0


def _check_ranges(args: argparse.Namespace) -> None:
    """ConfigError naming the first option out of its range."""
    for names, bad, must in ((_POSITIVE, lambda value: value <= 0, "be positive"),
                             (_NON_NEGATIVE, lambda value: value < 0, "not be negative")):
        for name in names:
            if bad(getattr(args, name)):
                raise ConfigError(f"{_flags([name])} must {must}, got {getattr(args, name)}")


def _cost_report(args: argparse.Namespace) -> dict[str, Any]:
    comparison = compare_costs(
        MemoryTier(PAPER_DRAM.name, args.dram_size, args.dram_price, args.dram_power),
        MemoryTier(PAPER_HIFC.name, args.flash_size, args.flash_price, args.flash_power),
        Operation(args.years, args.pue, args.energy_price),
    )
    return {
        "years": args.years,
        "pue": args.pue,
        "energy_cost_per_kwh": args.energy_price,
        "tiers": [_tier_row(comparison.dram), _tier_row(comparison.flash)],
        "dram_to_flash_ratio": comparison.ratio,
    }


def _tier_row(cost: TierCost) -> dict[str, Any]:
    tier = cost.tier
    return {"name": tier.name, "capacity_bytes": tier.capacity_bytes, "price_per_gib": tier.price_per_gib,
            "power_w": tier.power_w, "capex": cost.capex, "opex": cost.opex, "total": cost.total}


def _endurance_report(args: argparse.Namespace) -> dict[str, Any]:
    endurance = FlashEndurance(args.pe_cycles, args.pslc_size, args.rated_tbw)
    bytes_per_day, source = _daily_writes(args)
    # No swap-out at all wears nothing: the lifetime is unbounded, reported as null.
    lifetime = endurance.lifetime_years(bytes_per_day, args.waf) if bytes_per_day else None
    return {
        "pe_cycles": endurance.pe_cycles,
        "region_bytes": endurance.region_bytes,
        "tbw_bytes": endurance.tbw_bytes,
        "rated_tbw_bytes": endurance.rated_tbw_bytes,
        "gain_over_rating": endurance.gain_over_rating,
        "bytes_per_day": bytes_per_day,
        "bytes_per_day_source": source,
        "write_amplification": args.waf,
        "lifetime_years": lifetime,
    }


def _daily_writes(args: argparse.Namespace) -> tuple[float, str]:
    if args.measured:
        return _read_measured(Path(args.measured)), f"measured in {args.measured}"
    if args.writes_per_day is not None:
        return args.writes_per_day, "--writes-per-day"
    return PAPER_KV_WRITES_PER_DAY, "paper's sustained GovReport load"


def _read_measured(path: Path) -> float:
    expected = 'a serve benchmark result with {"swap_out_bytes": N, "wall_s": S}'
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}; pass {expected}") from err
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not JSON ({err.msg}, line {err.lineno}); pass {expected}") from err
    values = [data.get(key) if isinstance(data, dict) else None for key in ("swap_out_bytes", "wall_s")]
    if not all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values):
        raise ConfigError(f"{path} lacks numeric swap_out_bytes and wall_s; pass {expected}")
    try:
        return writes_per_day(*values)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from err


def _pipeline_report(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {}
    if _complete(args, _GAP_OPTIONS):
        report["t_gap_s"] = gap_budget_s(args.tps_ideal, args.tps_test, args.t_lat)
    if _complete(args, _SWAP_OPTIONS):
        report["t_swap_s"] = swap_time_s(args.n_swap, args.block_tokens, args.token_bytes, args.flash_bw, args.t_fix)
    if len(report) == 2:
        report["swap_hidden"] = swap_hidden(report["t_swap_s"], report["t_gap_s"])
    return report


def _complete(args: argparse.Namespace, names: tuple[str, ...]) -> bool:
    """True when all of `names` were given, False when none was; a partial set is an error."""
    missing = [name for name in names if getattr(args, name) is None]
    if missing and len(missing) < len(names):
        raise ConfigError(f"pipeline budget: also give {_flags(missing)}, or none of {_flags(names)}")
    return not missing


def _flags(names: list[str] | tuple[str, ...]) -> str:
    return ", ".join("--" + name.replace("_", "-") for name in names)


def _render(report: dict[str, Any]) -> str:
    return "\n\n".join(
        part for part in (_render_cost(report["cost"]), _render_endurance(report["endurance"]),
                          _render_pipeline(report.get("pipeline"))) if part
    )


def _render_cost(cost: dict[str, Any]) -> str:
    lines = [
        f"Memory-expansion cost over {cost['years']:g} years "
        f"(PUE {cost['pue']:.2f}, ${cost['energy_cost_per_kwh']:.3f}/kWh)",
        f"  {'tier':<6}{'capacity':>10}{'$/GiB':>8}{'power':>10}{'CapEx':>11}{'OpEx':>10}{'total':>11}",
    ]
    for tier in cost["tiers"]:
        lines.append(
            f"  {tier['name']:<6}{format_size(tier['capacity_bytes']):>10}{tier['price_per_gib']:>8.2f}"
            f"{tier['power_w']:>8.2f} W{_usd(tier['capex']):>11}{_usd(tier['opex']):>10}{_usd(tier['total']):>11}"
        )
    lines.append(f"  DRAM / HiFC: {cost['dram_to_flash_ratio']:.2f}x")
    return "\n".join(lines)


def _usd(value: float) -> str:
    return f"${value:,.2f}"


def _render_endurance(endurance: dict[str, Any]) -> str:
    tbw = endurance["tbw_bytes"]
    lines = [
        f"pSLC endurance: {endurance['pe_cycles']} P/E cycles x {format_size(endurance['region_bytes'])} = "
        f"{_tib(tbw)} ({tbw / TB:,.0f} TB) written; "
        f"{endurance['gain_over_rating']:.2f}x the {endurance['rated_tbw_bytes'] / TB:,.0f} TB rating",
    ]
    per_day = f"{_tib(endurance['bytes_per_day'])}/day ({endurance['bytes_per_day_source']})"
    if endurance["lifetime_years"] is None:
        lines.append(f"Lifetime: unbounded, no bytes written ({per_day})")
    else:
        lines.append(
            f"Lifetime: {endurance['lifetime_years']:.2f} years at {per_day}, "
            f"WAF {endurance['write_amplification']:.2f}"
        )
    return "\n".join(lines)


def _tib(num_bytes: float) -> str:
    # Two decimals: the paper's 1.98 TiB/day must not print as 2.0.
    return f"{num_bytes / TIB:,.2f} TiB"


def _render_pipeline(pipeline: dict[str, Any] | None) -> str:
    if not pipeline:
        return ""
    parts = [f"{name} {pipeline[key]:.3f} s" for name, key in (("T_gap", "t_gap_s"), ("T_swap", "t_swap_s"))
             if key in pipeline]
    if "swap_hidden" in pipeline:
        parts.append("swap hidden" if pipeline["swap_hidden"] else "swap exceeds the budget: it slows decoding")
    return "Pipeline budget: " + ", ".join(parts)
