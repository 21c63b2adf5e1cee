"""The paper's cost, endurance and pipeline formulas against its own numbers (the HiFC paper)."""

import pytest

from kvtier.errors import ConfigError
from kvtier.eval.serving.costmodel import (
    GIB,
    PAPER_DRAM,
    PAPER_HIFC,
    PAPER_KV_WRITES_PER_DAY,
    TB,
    TIB,
    FlashEndurance,
    MemoryTier,
    Operation,
    compare_costs,
    gap_budget_s,
    lifetime_years,
    mem_exp_cost,
    swap_hidden,
    swap_time_s,
    writes_per_day,
)


def test_mem_exp_cost_is_capex_plus_energy_over_the_years():
    # 10 W for 1 year = 87.6 kWh; x PUE 2 x $0.10 = $17.52.
    assert mem_exp_cost(100.0, power_w=10.0, years=1, pue=2.0, energy_cost_per_kwh=0.10) == pytest.approx(117.52)


def test_defaults_reproduce_table12_totals_and_ratio():
    comparison = compare_costs()
    assert comparison.dram.capex == pytest.approx(128 * 5.06)  # $647.68, paper's price x capacity
    assert comparison.flash.capex == pytest.approx(1024 * 0.10)  # $102.40
    assert comparison.dram.total == pytest.approx(729.0, abs=0.02)
    assert comparison.flash.total == pytest.approx(120.0, abs=0.02)
    assert round(comparison.ratio, 1) == 6.1


def test_opex_scales_with_years_pue_and_price():
    base = PAPER_DRAM.cost(Operation())
    doubled = PAPER_DRAM.cost(Operation(years=6.0))
    pricier = PAPER_DRAM.cost(Operation(pue=3.0, energy_cost_per_kwh=0.24))
    assert doubled.opex == pytest.approx(2 * base.opex)
    assert pricier.opex == pytest.approx(4 * base.opex)
    assert doubled.capex == base.capex


def test_custom_tiers_are_compared():
    dram = MemoryTier("DRAM", 64 * GIB, price_per_gib=4.0, power_w=0.0)
    flash = MemoryTier("HiFC", 2048 * GIB, price_per_gib=0.05, power_w=0.0)
    comparison = compare_costs(dram, flash, Operation())
    assert comparison.dram.total == pytest.approx(256.0)
    assert comparison.flash.total == pytest.approx(102.4)
    assert comparison.ratio == pytest.approx(2.5)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Operation(pue=0.9),
        lambda: Operation(years=0),
        lambda: Operation(energy_cost_per_kwh=-0.1),
        lambda: MemoryTier("DRAM", 0, 5.06, 17.0),
        lambda: MemoryTier("DRAM", GIB, -1.0, 17.0),
        lambda: MemoryTier("DRAM", GIB, 5.06, -1.0),
        lambda: FlashEndurance(pe_cycles=0),
    ],
)
def test_impossible_inputs_raise_config_error(make):
    with pytest.raises(ConfigError):
        make()


def test_paper_endurance_figures_are_exact_in_decimal_units():
    # The paper's "30,000 x 200 GiB = 6,000 TiB" and "8x" hold when the region is 200 GB.
    endurance = FlashEndurance(pe_cycles=30_000, region_bytes=200 * 1000**3, rated_tbw_bytes=750 * TB)
    assert endurance.tbw_bytes == 6_000 * TB
    assert endurance.gain_over_rating == pytest.approx(8.0)
    assert endurance.lifetime_years(1.98 * TB) == pytest.approx(8.30, abs=0.005)


def test_paper_lifetime_formula_with_its_printed_numbers():
    assert lifetime_years(6_000 * TIB, 1.98 * TIB) == pytest.approx(8.30, abs=0.005)


def test_default_endurance_uses_binary_region_as_labelled():
    endurance = FlashEndurance()
    assert endurance.tbw_bytes == 30_000 * 200 * GIB
    assert endurance.tbw_bytes / TIB == pytest.approx(5_859.375)
    assert endurance.gain_over_rating == pytest.approx(8.59, abs=0.005)
    assert endurance.lifetime_years(PAPER_KV_WRITES_PER_DAY) == pytest.approx(8.11, abs=0.005)


def test_write_amplification_shortens_lifetime():
    endurance = FlashEndurance()
    assert endurance.lifetime_years(TIB, 1.4) == pytest.approx(endurance.lifetime_years(TIB) / 1.4)
    with pytest.raises(ConfigError, match="at least 1.0"):
        endurance.lifetime_years(TIB, 0.9)
    with pytest.raises(ConfigError, match="per day"):
        endurance.lifetime_years(0)


def test_writes_per_day_from_a_measured_run():
    assert writes_per_day(GIB, wall_s=3600) == pytest.approx(24 * GIB)
    assert writes_per_day(0, wall_s=10) == 0
    with pytest.raises(ConfigError, match="wall_s"):
        writes_per_day(GIB, wall_s=0)


def test_gap_budget():
    assert gap_budget_s(tps_ideal=100.0, tps_test=90.0, t_lat_s=0.207) == pytest.approx(2.07)
    assert gap_budget_s(tps_ideal=90.0, tps_test=100.0, t_lat_s=0.2) < 0


def test_swap_time():
    # 10 blocks x 64 tokens x 256 KiB = 160 MiB at 4 GiB/s = 39.0625 ms, plus 100 ms fixed.
    t_swap = swap_time_s(10, block_tokens=64, token_bytes=256 * 1024, flash_bw_bytes_per_s=4 * GIB, t_fix_s=0.1)
    assert t_swap == pytest.approx(0.1390625)
    with pytest.raises(ConfigError, match="bandwidth"):
        swap_time_s(1, 64, 1024, 0)


def test_paper_swap_is_hidden_inside_its_gap():
    assert swap_hidden(t_swap_s=0.266, t_gap_s=2.07)
    assert swap_hidden(t_swap_s=2.07, t_gap_s=2.07)
    assert not swap_hidden(t_swap_s=2.5, t_gap_s=2.07)


def test_paper_tiers_are_the_table12_inputs():
    assert (PAPER_DRAM.capacity_bytes, PAPER_DRAM.price_per_gib) == (128 * GIB, 5.06)
    assert (PAPER_HIFC.capacity_bytes, PAPER_HIFC.price_per_gib) == (1024 * GIB, 0.10)
