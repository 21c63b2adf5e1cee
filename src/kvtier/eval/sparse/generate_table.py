"""`kvtier bench generate`'s results as a table: a row per corpus and KV mode, ratios taken within each round."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from kvtier.units import format_size


def table_rows(result: dict) -> list[dict]:
    """Per corpus and mode: the median over rounds of ms/token and of its first and later passes; speed vs offload
    (median of the rounds' ratios, over the whole decode and over the first passes); disk bytes per answer and their
    share of offload's; time to the first token; whether every round's answer equals dense's of that round."""
    rows = []
    for corpus, measured in result["corpora"].items():
        runs = measured["runs"]
        for mode, mode_runs in runs.items():
            rows.append({
                "corpus": corpus, "mode": mode,
                "ms_per_token": _median(run["ms_per_token"] for run in mode_runs),
                "round_ms_per_token": [run["ms_per_token"] for run in mode_runs],
                "first_steps_ms": _median(run["first_steps_ms"] for run in mode_runs),
                "later_steps_ms": _median(run["later_steps_ms"] for run in mode_runs),
                "vs_offload": _round_ratio(runs, mode, "ms_per_token"),
                "first_vs_offload": _round_ratio(runs, mode, "first_steps_ms"),
                "disk_bytes_read": _median(run["disk_bytes_read"] for run in mode_runs),
                "bytes_vs_offload": _bytes_share(runs, mode),
                "ttft_s": _median(run["ttft_s"] for run in mode_runs),
                "same_as_dense": _same_as_dense(runs, mode),
            })
    return rows


def _median(values) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def _round_ratio(runs: dict[str, list[dict]], mode: str, field: str) -> float | None:
    """Median over rounds of offload's `field` over the mode's; None without offload, for offload itself, or when
    the field is missing."""
    if "offload" not in runs or mode == "offload":
        return None
    return _median(offload[field] / run[field] if offload[field] and run[field] else None
                   for offload, run in zip(runs["offload"], runs[mode]))


def _bytes_share(runs: dict[str, list[dict]], mode: str) -> float | None:
    if "offload" not in runs:
        return None
    offload = _median(run["disk_bytes_read"] for run in runs["offload"])
    return _median(run["disk_bytes_read"] for run in runs[mode]) / offload if offload else None


def _same_as_dense(runs: dict[str, list[dict]], mode: str) -> bool | None:
    """Every round's answer equal to dense's in the same round; None without dense."""
    if "dense" not in runs:
        return None
    return all(run["text"] == dense["text"] for dense, run in zip(runs["dense"], runs[mode]))


def markdown(result: dict) -> str:
    """The settings, the table of `table_rows` and dense's answer per corpus."""
    first = result["first_steps"]
    dropped = all(run["page_cache_dropped"] for corpus in result["corpora"].values()
                  for runs in corpus["runs"].values() for run in runs)
    lines = [f"# `kvtier generate` per corpus: {result['model']}, {result['context']}-token documents",
             "", f"`--device-kv-budget {result['device_kv_budget']} --host-kv-budget {result['host_kv_budget']}`, "
             f"{result['max_new_tokens']} new tokens at most, {result['rounds']} alternating round(s) of "
             f"{', '.join(result['modes'])}, one fresh process per run, every run reading the document's prefill "
             "from the document KV store (stored by one untimed run first); KV files read with O_DIRECT, page cache "
             f"{'dropped before every run' if dropped else 'NOT dropped (the process may not)'}. ms/token is the "
             f"decode time over the passes after the first token; 'first {first}' is the mean of the first {first} "
             "passes, 'later' the median of the rest. Ratios vs offload are medians of the rounds' ratios.", "",
             f"| corpus | mode | ms/token (rounds) | first {first} ms | later ms | vs offload | first {first} vs "
             "offload | disk read/answer | bytes vs offload | first token s | answer = dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in table_rows(result):
        rounds = ", ".join(f"{ms:.0f}" for ms in row["round_ms_per_token"])
        lines.append(f"| {row['corpus']} | {row['mode']} | {row['ms_per_token']:.1f} ({rounds}) | "
                     f"{_number(row['first_steps_ms'])} | {_number(row['later_steps_ms'])} | "
                     f"{_number(row['vs_offload'], 'x')} | {_number(row['first_vs_offload'], 'x')} | "
                     f"{format_size(int(row['disk_bytes_read']))} | {_share(row['bytes_vs_offload'])} | "
                     f"{row['ttft_s']:.2f} | {_yes_no(row['same_as_dense'])} |")
    lines += ["", "Answers (the first round's, dense where it ran):", ""]
    for corpus, measured in result["corpora"].items():
        runs = measured["runs"]
        answer = runs.get("dense", next(iter(runs.values())))[0]["text"]
        lines.append(f"- {corpus}: {json.dumps(answer[:160])}")
    return "\n".join(lines) + "\n"


def write_results(result: dict, out: Path) -> Path:
    """`generate-corpora-<model>-<context>.json` and `.md` under `out`, the markdown printed too; the stem."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"generate-corpora-{Path(result['model']).name}-{result['context']}"  # names may hold dots
    Path(f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    Path(f"{stem}.md").write_text(text)
    print(text)
    print(f"wrote {stem}.json and {stem}.md")
    return stem


def _number(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.{2 if unit else 1}f}{unit}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")
