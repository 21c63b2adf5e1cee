"""`kvtier bench sparse --corpora`: one run's results over several corpora as one table (a row per corpus and mode),
with the step's drift over a long decode as the medians of consecutive windows of steps."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from kvtier.units import format_size

WINDOW = 16  # decode steps per drift window


def window_medians(step_ms: list[float], window: int = WINDOW) -> list[float]:
    """The median of each consecutive `window` steps (a last, shorter window too); [] for no steps."""
    return [statistics.median(step_ms[start:start + window]) for start in range(0, len(step_ms), window)]


def corpora_result(results: dict[str, dict]) -> dict:
    """The record of one run over corpora: each corpus's `kvtier bench sparse` result under "runs"."""
    first = next(iter(results.values()))
    return {"model": first["model"], "context": first["context"], "batch": first["batch"], "device": first["device"],
            "new_tokens": first["new_tokens"], "repeats": first.get("repeats", 1), "corpora": list(results),
            "runs": results}


def table_rows(result: dict) -> list[dict]:
    """Per corpus and mode: median step over the rounds, its spread, speed against offload and dense (median of the
    rounds' ratios where recorded), disk bytes per step and their share of offload's, and the median round's drift."""
    rows = []
    for corpus, run in result["runs"].items():
        offload, dense = run["modes"].get("offload"), run["modes"].get("dense")
        for mode, row in run["modes"].items():
            ratios = run.get("round_ratios", {}).get(mode)
            rows.append({
                "corpus": corpus, "mode": mode, "median_step_ms": row["median_step_ms"],
                "round_medians_ms": row.get("round_median_step_ms", [row["median_step_ms"]]),
                "vs_offload": float(np.median(ratios)) if ratios else None,
                "vs_dense_step": row["median_step_ms"] / dense["median_step_ms"] if dense else None,
                "disk_read_bytes_per_step": row["disk_read_bytes_per_step"],
                "bytes_vs_offload": (row["disk_read_bytes_per_step"] / offload["disk_read_bytes_per_step"]
                                     if offload and offload["disk_read_bytes_per_step"] else None),
                "window_medians_ms": window_medians(row["step_ms"]),
            })
    return rows


def corpora_markdown(result: dict) -> str:
    """The table of `table_rows` with the run's settings above it."""
    lines = [f"# sparse vs offload over corpora: {result['model']}, {result['context']} tokens x {result['batch']}",
             "", f"{result['new_tokens']} timed decode steps per mode and round, {result['repeats']} alternating "
             f"round(s) per corpus; each corpus's own table (budgets, breakdown, recall) is in "
             f"sparse-{result['model']}-{result['context']}-b{result['batch']}-<corpus>.md. Speed vs offload is the median of the rounds' ratios; the drift column "
             f"holds the median of every {WINDOW} steps of the median round.", "",
             "| corpus | mode | median ms/step (rounds) | vs offload | step vs dense | disk read/step | bytes vs offload "
             f"| per-{WINDOW}-step medians ms |", "|---|---|---|---|---|---|---|---|"]
    for row in table_rows(result):
        rounds = ", ".join(f"{ms:.0f}" for ms in row["round_medians_ms"])
        drift = " / ".join(f"{ms:.0f}" for ms in row["window_medians_ms"])
        lines.append(f"| {row['corpus']} | {row['mode']} | {row['median_step_ms']:.1f} ({rounds}) | "
                     f"{_ratio(row['vs_offload'], 'x')} | {_ratio(row['vs_dense_step'], 'x')} | "
                     f"{format_size(int(row['disk_read_bytes_per_step']))} | {_share(row['bytes_vs_offload'])} | "
                     f"{drift} |")
    return "\n".join(lines) + "\n"


def write_corpora_results(result: dict, out: Path) -> None:
    """`<stem>.json` and `<stem>.md` under `out`, the markdown printed too."""
    stem = out / _stem(result)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = corpora_markdown(result)
    stem.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {stem}.json and {stem}.md")


def _stem(result: dict) -> str:
    stem = f"sparse-corpora-{result['model']}-{result['context']}-b{result['batch']}"
    return stem if result.get("device", "cpu") == "cpu" else f"{stem}-{result['device'].replace(':', '')}"


def _ratio(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"
