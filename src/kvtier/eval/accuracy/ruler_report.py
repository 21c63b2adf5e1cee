"""`kvtier bench ruler`'s results as a summary and markdown (its plot, retention per family per mode, is drawn by
kvtier.eval.report.markdown_report.ruler_plot, beside the report's other plots).

Scores are RULER's: each answer scores the share of the expected strings it names (string_match_all); a task's
score is the mean over its cells, a family's the mean of its tasks', the average the mean over tasks (RULER's
average). Retention = a mode's summed score / dense's over the cells both ran (None where dense scored 0).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from kvtier.data.ruler import FAMILIES, TASKS
from kvtier.errors import StorageError
from kvtier.eval.accuracy.ruler_grid import MUST_EQUAL, REFERENCE, SUITE_MODES
from kvtier.units import format_size

PLOTS_DIR = "plots"
ALL = "all"


def summary(cells: list[dict]) -> dict[str, dict]:
    """Per mode (in the suite's order): `tasks` and `families` mean scores, `average`, and `retention` per family
    and over all (`ALL`) against the reference mode, on the cells both ran."""
    by_mode: dict[str, dict[tuple, dict]] = {}
    for cell in cells:
        by_mode.setdefault(cell["mode"], {})[(cell["task"], cell["context"], cell["seed"])] = cell
    reference = by_mode.get(REFERENCE, {})
    return {mode: _mode_summary(by_mode[mode], reference) for mode in _ordered(by_mode)}


def _mode_summary(cells: dict[tuple, dict], reference: dict[tuple, dict]) -> dict:
    tasks = {task: statistics.fmean(cell["score"] for (t, _, _), cell in cells.items() if t == task)
             for task in TASKS if any(t == task for t, _, _ in cells)}
    families = {name: statistics.fmean(score for task, score in tasks.items() if TASKS[task][0] == name)
                for name in FAMILIES if any(TASKS[task][0] == name for task in tasks)}
    shared = [coordinates for coordinates in cells if coordinates in reference]
    retention = {name: _retention(cells, reference, [c for c in shared if TASKS[c[0]][0] == name])
                 for name in families}
    return {"tasks": tasks, "families": families, "average": statistics.fmean(tasks.values()),
            "retention": retention | {ALL: _retention(cells, reference, shared)}, "cells": len(cells)}


def _retention(cells: dict[tuple, dict], reference: dict[tuple, dict], shared: list[tuple]) -> float | None:
    reference_score = sum(reference[coordinates]["score"] for coordinates in shared)
    return sum(cells[c]["score"] for c in shared) / reference_score if reference_score else None


def _ordered(modes) -> list[str]:
    """The suite's modes in its table's order, then any others (a file from a later table)."""
    return [mode for mode in SUITE_MODES if mode in modes] + sorted(set(modes) - set(SUITE_MODES))


def equality_checks(cells: list[dict]) -> dict[str, tuple[int, int]]:
    """For each mode that must repeat another's tokens: (samples where it did, samples both ran)."""
    by_key = {(cell["mode"], cell["task"], cell["context"], cell["seed"]): cell for cell in cells}
    checks = {}
    for mode, reference in MUST_EQUAL.items():
        pairs = [(cell, by_key.get((reference, *key[1:]))) for key, cell in by_key.items() if key[0] == mode]
        pairs = [(cell, other) for cell, other in pairs if other is not None]
        if pairs:
            checks[mode] = (sum(cell["token_ids"] == other["token_ids"] for cell, other in pairs), len(pairs))
    return checks


def markdown(data: dict, plot_name: str | None = None) -> str:
    """The run as a report: settings, retention per family, scores per family and task, per context, costs."""
    cells = list(data["cells"].values())
    rows = summary(cells)
    lines = [f"# RULER-style suite: {data['settings']['model']}, every KV mode against {REFERENCE}", "",
             settings_text(data, cells), ""]
    lines += retention_table(rows) + _score_tables(rows) + _context_table(cells) + _cost_table(cells)
    lines += _budget_table(cells)
    checks = equality_checks(cells)
    lines += [f"Exactness check: {mode} repeated {MUST_EQUAL[mode]}'s tokens on {same}/{total} samples." for
              mode, (same, total) in checks.items()] + [""]
    if plot_name:
        lines += [f"![retention per task family]({PLOTS_DIR}/{plot_name})", ""]
    return "\n".join(lines)


def settings_text(data: dict, cells: list[dict]) -> str:
    settings = data["settings"]
    corpus = settings["corpus"]
    contexts = sorted({cell["context"] for cell in cells})
    samples = len({cell["seed"] for cell in cells})
    return (f"Tasks generated offline from {corpus['name']} ({corpus['license']}, {corpus['source']}); contexts "
            f"{', '.join(map(str, contexts))} tokens (prompt and answer), {samples} samples per task and context; "
            f"greedy answers scored by RULER's string match (share of the expected strings named). Question "
            f"answering over documents is left out (no registry package ships such a data set with its "
            f"documents). Budgets per cell: host {settings['host_share']:.0%} of the context's KV, device "
            f"{settings['device_share']:.0%} (at least {settings['min_device_tokens']} tokens); selective modes "
            f"attend sink + alpha x pooled + recent window; beta {settings['beta']}. One dense prefill per sample, "
            f"replayed into each mode with its queries; the last {settings['live_tokens']} prompt tokens run per "
            f"mode. KV file cache bypass: {settings['cache_bypass']}.")


def retention_table(rows: dict[str, dict]) -> list[str]:
    """Markdown lines: a heading and one row per mode of `summary`'s retention per family and over all."""
    header = [*FAMILIES, ALL]
    lines = [f"## Retention vs {REFERENCE} (summed score over the same cells)", "",
             "| mode | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for mode, row in rows.items():
        lines.append(f"| {mode} | " + " | ".join(_ratio(row["retention"].get(name)) for name in header) + " |")
    return lines + [""]


def _score_tables(rows: dict[str, dict]) -> list[str]:
    lines = ["## Score per family (mean, %)", "", "| mode | " + " | ".join(FAMILIES) + " | average |",
             "|---|" + "---|" * (len(FAMILIES) + 1)]
    for mode, row in rows.items():
        lines.append(f"| {mode} | " + " | ".join(_percent(row["families"].get(name)) for name in FAMILIES)
                     + f" | {_percent(row['average'])} |")
    modes = list(rows)
    lines += ["", "## Score per task (mean, %)", "", "| task | " + " | ".join(modes) + " |",
              "|---|" + "---|" * len(modes)]
    for task in TASKS:
        if any(task in row["tasks"] for row in rows.values()):
            lines.append(f"| {task} | " + " | ".join(_percent(rows[mode]["tasks"].get(task)) for mode in modes) + " |")
    return lines + [""]


def _context_table(cells: list[dict]) -> list[str]:
    contexts = sorted({cell["context"] for cell in cells})
    lines = ["## Score per context (mean over tasks and samples, %)", "",
             "| mode | " + " | ".join(map(str, contexts)) + " |", "|---|" + "---|" * len(contexts)]
    for mode in _ordered({cell["mode"] for cell in cells}):
        means = [_mean([cell["score"] for cell in cells if cell["mode"] == mode and cell["context"] == context])
                 for context in contexts]
        lines.append(f"| {mode} | " + " | ".join(_percent(mean) for mean in means) + " |")
    return lines + [""]


def _cost_table(cells: list[dict]) -> list[str]:
    lines = ["## Cost per answer (median over cells)", "", "| mode | decode ms/token | disk read per answer |",
             "|---|---|---|"]
    for mode in _ordered({cell["mode"] for cell in cells}):
        own = [cell for cell in cells if cell["mode"] == mode]
        lines.append(f"| {mode} | {statistics.median(cell['ms_per_token'] for cell in own):.1f} | "
                     f"{format_size(int(statistics.median(cell['disk_bytes_read'] for cell in own)))} |")
    return lines + [""]


def _budget_table(cells: list[dict]) -> list[str]:
    """Per sparse mode and family: cold bytes read per decode step, the estimated attention mass kept and the share
    of pooled tokens attended (means over cells), and the top-p guard's events (summed); none without such cells."""
    budgeted = [cell for cell in cells if cell.get("attention_budget") and cell["attention_budget"]["mass_kept_mean"]
                is not None]
    if not budgeted:
        return []
    lines = ["## Cold reads and attention kept per family (sparse modes; mean over cells)", "",
             "| mode | family | cold read per decode step | estimated mass kept (least) | share attended | "
             "guard events |", "|---|---|---|---|---|---|"]
    for mode in _ordered({cell["mode"] for cell in budgeted}):
        for name in FAMILIES:
            own = [cell for cell in budgeted if cell["mode"] == mode and cell["family"] == name]
            if not own:
                continue
            reports = [cell["attention_budget"] for cell in own]
            per_step = _mean([cell["disk_bytes_read"] / max(len(cell["token_ids"]) - 1, 1) for cell in own])
            lines.append(f"| {mode} | {name} | {format_size(int(per_step))} | "
                         f"{_mean([report['mass_kept_mean'] for report in reports]):.3f} "
                         f"({min(report['mass_kept_min'] for report in reports):.3f}) | "
                         f"{_mean([report['attended_share'] for report in reports]):.3f} | "
                         f"{sum(report['guard_events'] for report in reports)} |")
    return lines + [""]


def write_markdown(json_path: Path, data: dict) -> Path:
    """`<stem>.md` beside the results file, linking `plots/<stem>.png`; its path."""
    path = json_path.with_suffix(".md")
    text = markdown(data, f"{json_path.stem}.png")
    try:
        path.write_text(text)
    except OSError as error:
        raise StorageError(f"cannot write {path}: {error.strerror}") from None
    print(text)
    return path


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
