"""Text forms of measured values in markdown reports: spreads over repeats and right/total tallies."""

from __future__ import annotations


def spread_text(values: dict | None, fmt: str) -> str:
    """`median [min, max] (n=N)` of a `record.spread`, the median alone for one value, `-` for none."""
    if values is None:
        return "-"
    if values["n"] == 1:
        return format(values["median"], fmt)
    return f"{values['median']:{fmt}} [{values['min']:{fmt}}, {values['max']:{fmt}}] (n={values['n']})"


def tally_text(tally: dict | None) -> str:
    """`correct/n (accuracy%)`, or `-` for no tally."""
    return "-" if not tally else f"{tally['correct']}/{tally['n']} ({tally['accuracy']:.0%})"
