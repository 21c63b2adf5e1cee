"""`<results>/REPORT.md` with PNG plots in `<results>/plots/`, from whatever result files exist.

Reads `latency-*.json` (kvtier bench latency: one section per experiment a-f, one
subsection per model and grid), `accuracy-*.json` (kvtier bench accuracy) and `ruler-*.json`
(kvtier bench ruler); the caller
adds sections rendered from other files (`kvtier bench report` adds sparse-*.json and
serve.json). An experiment without a file says "not run yet" and how to run it. Files are
read in name order and the plots carry no dates, so the same files give the same report.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.data.ruler import FAMILIES
from kvtier.errors import StorageError
from kvtier.eval.accuracy.budgets import MIN_DEVICE_TOKENS
from kvtier.eval.sparse.latency_grid import ABLATION_STEPS, EXPERIMENTS, Experiment
from kvtier.eval.accuracy.needle_grid import needle_summary
from kvtier.eval.accuracy.perplexity import perplexity_summary
from kvtier.eval.accuracy.ruler_report import ALL, retention_table, summary as ruler_summary
from kvtier.eval.report.plots import Series, bar_plot, grouped_bars, line_plot, pyplot, scatter_plot, stacked_bars
from kvtier.eval.report_text import spread_text, tally_text
from kvtier.eval.serving.serve_bench import render_markdown as serve_markdown
from kvtier.eval.sparse.corpora_table import corpora_markdown
from kvtier.eval.sparse.sparse_bench import markdown as sparse_markdown
from kvtier.eval.sparse.traffic import DIRECTIONS
from kvtier.kv_config import EXACT_MODES, KV_MODES
from kvtier.sparse import describe_threads
from kvtier.units import format_size

REPORT_NAME = "REPORT.md"
PLOTS_DIR = "plots"


@dataclass
class Results:
    """The result files of one directory, grouped by what wrote them."""

    latency: dict[str, list[dict]] = field(default_factory=dict)  # experiment name -> files
    accuracy: list[dict] = field(default_factory=list)
    ruler: list[dict] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def load_results(directory: Path) -> Results:
    """Every latency-*.json, accuracy-*.json and ruler-*.json in `directory`, in name order (each with its `file`
    name)."""
    results = Results()
    for path in sorted(directory.glob("latency-*.json")):
        data = read_json(path)
        results.latency.setdefault(data["settings"]["experiment"], []).append(data | {"file": path.name})
        results.files.append(path.name)
    for path in sorted(directory.glob("accuracy-*.json")):
        results.accuracy.append(read_json(path) | {"file": path.name})
        results.files.append(path.name)
    for path in sorted(directory.glob("ruler-*.json")):
        results.ruler.append(read_json(path) | {"file": path.name})
        results.files.append(path.name)
    return results


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise StorageError(f"cannot read results file {path}: {error}") from None


def appendices(directory: Path) -> list[tuple[str, str]]:
    """(title, markdown) of the sparse-*.json and serve.json files, rendered as their benchmarks render them (a run
    over corpora, sparse-corpora-*.json, as its table)."""
    sections = [(f"Sparse vs offload (`{path.name}`)",
                 (corpora_markdown if path.name.startswith("sparse-corpora-") else sparse_markdown)(read_json(path)))
                for path in sorted(directory.glob("sparse-*.json"))]
    serve = directory / "serve.json"
    if serve.is_file():
        sections.append(("Serve benchmark (`serve.json`)", serve_markdown(read_json(serve))))
    return sections


def write_report(directory: Path, appendices: list[tuple[str, str]] = ()) -> tuple[Path, list[Path]]:
    """Write REPORT.md and its plots; `appendices` are (title, markdown) sections added at the end.

    Returns the report's path and the plots written.
    """
    pyplot()  # no matplotlib: one clear error before anything is written
    results = load_results(directory)
    plots: list[Path] = []
    lines = header(results, [title for title, _ in appendices])
    for experiment in EXPERIMENTS.values():
        lines += experiment_section(experiment, results.latency.get(experiment.name, []), directory / PLOTS_DIR, plots)
    lines += accuracy_section(results.accuracy, directory / PLOTS_DIR, plots)
    lines += ruler_section(results.ruler, directory / PLOTS_DIR, plots)
    for title, markdown in appendices:
        lines += [f"## {title}", "", *demote_headings(markdown).rstrip().splitlines(), ""]
    report = directory / REPORT_NAME
    _write_atomically(report, "\n".join(lines).rstrip() + "\n")
    return report, plots


def header(results: Results, appendix_titles: list[str]) -> list[str]:
    files = ", ".join(f"`{name}`" for name in results.files) or "none yet"
    machines = {machine_text(data["machine"]) for group in results.latency.values() for data in group}
    machines |= {machine_text(data["machine"]) for data in results.accuracy + results.ruler}
    return [
        "# kvtier benchmark report", "",
        "Regenerate with `kvtier bench report`; the numbers come from `kvtier bench latency` (experiments a-f of "
        "the HillInfer paper's evaluation) and `kvtier bench accuracy`. Timed values are medians [min, max] (n=runs) "
        "over the repeats; every mode is timed by the same loop (prefill, one untimed decode step, timed steps).", "",
        f"Result files: {files}" + (f"; also {', '.join(appendix_titles)}." if appendix_titles else "."), "",
        *(f"Machine: {text}" for text in sorted(machines)), "",
    ]


def machine_text(machine: dict) -> str:
    """Cores, memory, disk and versions of a result file's `machine` record, on one line."""
    disk = machine.get("disk") or {}
    kind = {True: "rotational", False: "flash"}.get(disk.get("rotational"), "kind unknown")
    versions = ", ".join(f"{name} {version}" for name, version in machine.get("versions", {}).items())
    return (f"{machine.get('cpu_cores')} cores ({machine.get('cpu_model')}), "
            f"{format_size(machine.get('memory_bytes') or 0)} memory, KV disk {disk.get('fstype')} on "
            f"{disk.get('device')} ({kind}); {machine.get('platform')}; {versions}")


def experiment_section(experiment: Experiment, files: list[dict], plots_dir: Path, plots: list[Path]) -> list[str]:
    """The section of one latency experiment: per file a settings line, its table and its plot."""
    lines = [f"## ({experiment.letter}) {experiment.title}", ""]
    if not files:
        return lines + [f"_Not run yet: `kvtier bench latency --experiments {experiment.letter}`._", ""]
    for data in files:
        cells = ordered(data["cells"].values())
        settings = data["settings"]
        lines += [f"### {settings['model']}, {settings['grid']} grid (`{data['file']}`)", ""]
        if not cells:
            lines += ["_No finished cells yet._", ""]
            continue
        plot = plots_dir / f"{Path(data['file']).stem}.png"
        lines += [settings_text(settings, cells), "", *RENDERERS[experiment.name](cells, plot), "",
                  f"![{experiment.title}]({PLOTS_DIR}/{plot.name})", ""]
        plots.append(plot)
    return lines


def settings_text(settings: dict, cells: list[dict]) -> str:
    """Steps, repeats, budgets and cache bypass of one latency file."""
    first = cells[0]
    budgets, params = first["budgets"], first["params"]
    bypass = sorted({cell["cache_bypass"] for cell in cells if cell.get("cache_bypass")}) or ["no disk tier"]
    return (f"{settings['new_tokens']} timed decode steps after {settings['warmup_steps']} untimed, "
            f"repeats {settings['repeats']}; budgets per sequence: host {params['host_share']:.0%} of the prompt's KV, "
            f"device {settings['device_share']:.0%} (at least {MIN_DEVICE_TOKENS} tokens), e.g. "
            f"{format_size(budgets['host_kv_budget'])} host and {format_size(budgets['device_kv_budget'])} device for "
            f"{params['batch']} x {params['context']} "
            f"tokens ({format_size(budgets['prompt_kv_bytes'])} of KV); alpha {settings['alpha']}; torch threads "
            f"{describe_threads(settings['torch_threads'])}; corpus {settings['corpus']['name']}; KV file cache bypass: "
            f"{'; '.join(bypass)}.")


# ---------------------------------------------------------------- one renderer per experiment


def _context(cells: list[dict], plot: Path) -> list[str]:
    line_plot(plot, "Decode latency vs context length", "prompt tokens", "ms per decode step",
              _series(cells, "context", "ms_per_token"), log_x=True)
    return ["Decode ms per step:", "", *_pivot(cells, "context", lambda cell: spread_text(cell["ms_per_token"], ".1f"))]


def _batch(cells: list[dict], plot: Path) -> list[str]:
    line_plot(plot, "End-to-end latency vs batch size", "batch size", "prefill + decode, s",
              _series(cells, "batch", "latency_s"))
    return ["End-to-end latency (prefill + timed decode) and decode throughput:", "",
            *_pivot(cells, "batch", lambda cell: f"{spread_text(cell['latency_s'], '.2f')} s, "
                                                 f"{cell['tokens_per_s']['median']:.1f} tok/s")]


def _ablation(cells: list[dict], plot: Path) -> list[str]:
    bars = Series("ms per decode step")
    lines = ["| variant | ms per step | end-to-end s | beta (plan) | disk read per step |", "|---|---|---|---|---|"]
    for cell in cells:
        bars.add(cell["params"]["label"], cell["ms_per_token"])
        lines.append(f"| {cell['params']['label']} | {spread_text(cell['ms_per_token'], '.1f')} | "
                     f"{spread_text(cell['latency_s'], '.2f')} | {_plan_beta(cell)} | "
                     f"{format_size(int(cell['disk_read_bytes_per_step']['median']))} |")
    bar_plot(plot, "Ablation: ms per decode step", "ms per decode step", bars)
    return lines


def _beta(cells: list[dict], plot: Path) -> list[str]:
    fixed = sorted((cell for cell in cells if cell["params"]["beta"] != "auto"),
                   key=lambda cell: cell["params"]["beta"])
    auto = [cell for cell in cells if cell["params"]["beta"] == "auto"]
    line = Series("fixed beta")
    lines = ["| beta | ms per step | hot share of the pool | APP T_CPU / T_storage ms (predicted) |",
             "|---|---|---|---|"]
    for cell in fixed + auto:
        sparse = cell.get("sparse", {})
        if cell in fixed:
            line.add(cell["params"]["beta"], cell["ms_per_token"])
        lines.append(f"| {cell['params']['beta']}{' -> ' + _plan_beta(cell) if cell in auto else ''} | "
                     f"{spread_text(cell['ms_per_token'], '.1f')} | {sparse.get('hot_share', float('nan')):.2f} | "
                     f"{_predicted_text(sparse)} |")
    marker = _app_marker(auto[0]) if auto else None
    line_plot(plot, "Beta sweep (host budget = whole prompt KV)", "beta = Mc / Ms", "ms per decode step",
              [line] if fixed else [], log_x=True, marker=marker)
    return lines + ["", _beta_summary(fixed, auto)]


def _predicted_text(sparse: dict) -> str:
    """APP's predicted T_CPU / T_storage; only a run with beta auto has calibrated rates to predict from."""
    predicted = sparse.get("predicted_ms") or {}
    if not any(predicted.values()):
        return "-"
    return f"{predicted['T_CPU']:.2f} / {predicted['T_storage']:.2f}"


def _app_marker(cell: dict) -> tuple[str, float, float] | None:
    beta = (cell.get("sparse") or {}).get("beta")
    if not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta <= 0:  # None, or "inf": not on the axis
        return None
    return f"APP beta {beta:.3g}", beta, cell["ms_per_token"]["median"]


def _beta_summary(fixed: list[dict], auto: list[dict]) -> str:
    parts = []
    if fixed:
        best = min(fixed, key=lambda cell: cell["ms_per_token"]["median"])
        parts.append(f"Measured minimum at beta {best['params']['beta']} "
                     f"({best['ms_per_token']['median']:.1f} ms per step).")
    if auto:
        sparse = auto[0].get("sparse") or {}
        capped = " (capped by the host budget)" if sparse.get("capped_by_host_budget") else ""
        parts.append(f"APP chose beta {_plan_beta(auto[0])}{capped}: "
                     f"{auto[0]['ms_per_token']['median']:.1f} ms per step.")
    return " ".join(parts)


def _alpha(cells: list[dict], plot: Path) -> list[str]:
    points: dict[str, list[tuple[float, float, str]]] = {}
    lines = ["| mode | alpha | ms per step | needle accuracy |", "|---|---|---|---|"]
    for cell in sorted(cells, key=lambda cell: (cell["params"]["mode"], cell["params"]["alpha"])):
        params, accuracy = cell["params"], cell.get("accuracy")
        exact = params["mode"] in EXACT_MODES
        if accuracy:
            note = params["mode"] if exact else f"α={params['alpha']}"
            points.setdefault(params["mode"], []).append((cell["ms_per_token"]["median"], accuracy["accuracy"], note))
        lines.append(f"| {params['mode']} | {'-' if exact else params['alpha']} | "
                     f"{spread_text(cell['ms_per_token'], '.1f')} | {tally_text(accuracy)} |")
    scatter_plot(plot, "Accuracy vs latency over alpha", "ms per decode step", "needle accuracy", points,
                 y_range=(-0.05, 1.05))
    return lines


def _traffic(cells: list[dict], plot: Path) -> list[str]:
    labels = [cell["params"]["label"] for cell in cells]
    stacks = {direction: [cell["traffic_bytes_per_step"][direction] / 2**20 for cell in cells]
              for direction in DIRECTIONS}
    stacked_bars(plot, "Bytes moved per decode step", "MiB per decode step", labels, stacks)
    lines = [f"| mode | {' | '.join(DIRECTIONS)} | cache bypass |", "|---|" + "---|" * (len(DIRECTIONS) + 1)]
    for cell in cells:
        traffic = cell["traffic_bytes_per_step"]
        lines.append(f"| {cell['params']['label']} | "
                     + " | ".join(format_size(int(traffic[direction])) for direction in DIRECTIONS)
                     + f" | {cell.get('cache_bypass') or 'no disk tier'} |")
    return ["Bytes per decode step (all layers and sequences; medians over the repeats). storage->host, storage "
            "internal (the sparse path's scorer reading sketches next to the data) and host->storage are measured "
            "I/O; host->device and device->host are counted from the tokens each mode attends and retires "
            "(kvtier.eval.sparse.traffic).", "", *lines]


RENDERERS: dict[str, Callable[[list[dict], Path], list[str]]] = {
    "context": _context, "batch": _batch, "ablation": _ablation, "beta": _beta, "alpha": _alpha, "traffic": _traffic,
}


# ---------------------------------------------------------------- accuracy files


def accuracy_section(files: list[dict], plots_dir: Path, plots: list[Path]) -> list[str]:
    """Needle accuracy, retention and perplexity per mode from `kvtier bench accuracy` files."""
    lines = ["## Accuracy (kvtier bench accuracy)", ""]
    if not files:
        return lines + ["_Not run yet: `kvtier bench accuracy`._", ""]
    for data in files:
        cells = list(data["cells"].values())
        lines += [f"### {data['settings'].get('model')} (`{data['file']}`)", ""]
        needles = [cell for cell in cells if cell.get("kind") == "needle"]
        if not needles:
            lines += ["_No finished needle cells yet._", ""]
            continue
        summary = needle_summary(needles)
        ppl = perplexity_summary(cell for cell in cells if cell.get("kind") == "ppl")
        lines += ["| mode | needle accuracy | retention vs dense | ppl - dense ppl by context |", "|---|---|---|---|"]
        bars = Series("needle accuracy")
        for mode, row in summary.items():
            accuracy = row["all"]["accuracy"]
            bars.add(mode, {"median": accuracy, "min": accuracy, "max": accuracy})
            retention = "-" if row["retention"] is None else f"{row['retention']:.2f}"
            deltas = ", ".join(f"{context}: {spread_text(values['ppl_delta'], '+.3f')}"
                               for context, values in ppl.get(mode, {}).items()) or "-"
            lines.append(f"| {mode} | {tally_text(row['all'])} | {retention} | {deltas} |")
        plot = plots_dir / f"{Path(data['file']).stem}.png"
        bar_plot(plot, "Needle accuracy per KV mode", "accuracy", bars)
        plots.append(plot)
        lines += ["", f"![needle accuracy]({PLOTS_DIR}/{plot.name})", ""]
    return lines


def ruler_section(files: list[dict], plots_dir: Path, plots: list[Path]) -> list[str]:
    """Retention vs dense per task family and mode from `kvtier bench ruler` files, with a plot per file."""
    lines = ["## RULER-style suite (kvtier bench ruler)", ""]
    if not files:
        return lines + ["_Not run yet: `kvtier bench ruler`._", ""]
    for data in files:
        lines += [f"### {data['settings'].get('model')} (`{data['file']}`)", ""]
        if not data["cells"]:
            lines += ["_No finished cells yet._", ""]
            continue
        plot = plots_dir / f"{Path(data['file']).stem}.png"
        ruler_plot(plot, data)
        plots.append(plot)
        table = demote_headings("\n".join(retention_table(ruler_summary(list(data["cells"].values())))))
        lines += [*table.splitlines(), f"Scores per family, task and context, costs: `{Path(data['file']).stem}.md`.",
                  "", f"![retention per task family]({PLOTS_DIR}/{plot.name})", ""]
    return lines


def ruler_plot(path: Path, data: dict) -> None:
    """Retention vs dense per task family (and over all), one bar per mode of a `kvtier bench ruler` file."""
    rows = ruler_summary(list(data["cells"].values()))
    groups = [*FAMILIES, ALL]
    bars = {mode: [row["retention"].get(name) for name in groups] for mode, row in rows.items()}
    grouped_bars(path, f"RULER-style suite, {data['settings']['model']}: retention vs dense", "score / dense's",
                 groups, bars)


# ---------------------------------------------------------------- helpers


def ordered(cells) -> list[dict]:
    """Cells in reading order: ablation steps as the paper adds them, modes as KV_MODES lists them."""
    def rank(cell: dict) -> tuple:
        params = cell["params"]
        step = ABLATION_STEPS.index(params["variant"]) if params["variant"] in ABLATION_STEPS else len(ABLATION_STEPS)
        mode = KV_MODES.index(params["mode"]) if params["mode"] in KV_MODES else len(KV_MODES)
        return step, mode, params["mode"]

    return sorted(cells, key=rank)


def _pivot(cells: list[dict], row_field: str, text: Callable[[dict], str]) -> list[str]:
    """A markdown table: one row per value of `row_field` (stress rows marked), one column per variant."""
    columns = list(dict.fromkeys(cell["params"]["label"] for cell in cells))
    rows: dict[tuple, dict[str, str]] = {}
    for cell in cells:
        params = cell["params"]
        rows.setdefault((params[row_field], params.get("stress", False)), {})[params["label"]] = text(cell)
    lines = [f"| {row_field} | {' | '.join(columns)} |", "|---|" + "---|" * len(columns)]
    for (value, stress), row in sorted(rows.items()):
        lines.append(f"| {value}{' (stress)' if stress else ''} | "
                     + " | ".join(row.get(column, "-") for column in columns) + " |")
    return lines


def _series(cells: list[dict], x_field: str, metric: str) -> list[Series]:
    """One line per variant: `metric` spreads against `x_field`, sorted by x."""
    series: dict[str, Series] = {}
    for cell in sorted(cells, key=lambda cell: cell["params"][x_field]):
        series.setdefault(cell["params"]["label"], Series(cell["params"]["label"])).add(cell["params"][x_field],
                                                                                      cell[metric])
    return list(series.values())


def _plan_beta(cell: dict) -> str:
    beta = (cell.get("sparse") or {}).get("beta")
    return "-" if beta is None else beta if isinstance(beta, str) else f"{beta:.3g}"


def demote_headings(markdown: str) -> str:
    """Every markdown heading two levels down, so a stand-alone report nests under a report section."""
    return "\n".join("##" + line if line.startswith("#") else line for line in markdown.splitlines())


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    except OSError as error:
        raise StorageError(f"cannot write {path}: {error.strerror or error}") from None
