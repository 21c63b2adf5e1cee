"""The report's PNG plots (matplotlib, Agg backend): lines with min-max bars, bars, grouped and stacked bars,
scatter.

matplotlib is an optional dependency (`pip install 'kvtier[bench]'`); `pyplot()` says so
in one line when it is missing. PNGs carry no software or date metadata, so the same
results give the same files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvtier.errors import ConfigError

FIGURE_SIZE = (6.4, 4.0)


@dataclass
class Series:
    """One line: x values with the median and the min-max range of y."""

    label: str
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    low: list[float] = field(default_factory=list)
    high: list[float] = field(default_factory=list)

    def add(self, x: float, values: dict) -> None:
        """Append a point from a kvtier.eval.record.spread dict."""
        self.x.append(x)
        self.y.append(values["median"])
        self.low.append(values["min"])
        self.high.append(values["max"])

    def error_bars(self) -> list[list[float]]:
        return [[y - low for y, low in zip(self.y, self.low)], [high - y for y, high in zip(self.y, self.high)]]


def pyplot():
    """matplotlib.pyplot on the Agg backend; ConfigError with the install line when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("kvtier bench report draws its plots with matplotlib, which is not installed: "
                          "pip install 'kvtier[bench]'") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    return plt


def line_plot(path: Path, title: str, xlabel: str, ylabel: str, series: list[Series], log_x: bool = False,
              marker: tuple[str, float, float] | None = None) -> None:
    """Lines with min-max error bars; `marker` = (label, x, y) adds a starred point and a dashed line at x."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=FIGURE_SIZE)
    for line in series:
        axes.errorbar(line.x, line.y, yerr=line.error_bars(), marker="o", capsize=3, label=line.label)
    if marker is not None:
        label, x, y = marker
        axes.axvline(x, linestyle="--", color="grey")
        axes.plot([x], [y], marker="*", markersize=14, color="black", linestyle="none", label=label)
    if log_x:
        axes.set_xscale("log", base=2)
        ticks = sorted({x for line in series for x in line.x})
        axes.set_xticks(ticks, [f"{tick:g}" for tick in ticks])
        axes.minorticks_off()
    _finish(plt, figure, axes, path, title, xlabel, ylabel)


def bar_plot(path: Path, title: str, ylabel: str, bars: Series) -> None:
    """One bar per label (`bars.x` holds the labels), median height, min-max error bars."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=FIGURE_SIZE)
    positions = range(len(bars.x))
    axes.bar(positions, bars.y, yerr=bars.error_bars(), capsize=4, color="tab:blue")
    axes.set_xticks(list(positions), [str(label) for label in bars.x], rotation=20, ha="right")
    _finish(plt, figure, axes, path, title, "", ylabel, legend=False)


def grouped_bars(path: Path, title: str, ylabel: str, groups: list[str], bars: dict[str, list[float | None]]) -> None:
    """One group of bars per label in `groups`, one bar per key of `bars` (each a list aligned with `groups`; None
    leaves a gap)."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=FIGURE_SIZE)
    width = 0.8 / max(len(bars), 1)
    for i, (name, heights) in enumerate(bars.items()):
        positions = [group + (i - (len(bars) - 1) / 2) * width for group in range(len(groups))]
        drawn = [(x, height) for x, height in zip(positions, heights) if height is not None]
        axes.bar([x for x, _ in drawn], [height for _, height in drawn], width=width, label=name)
    axes.set_xticks(list(range(len(groups))), groups)
    _finish(plt, figure, axes, path, title, "", ylabel)


def stacked_bars(path: Path, title: str, ylabel: str, labels: list[str], stacks: dict[str, list[float]]) -> None:
    """One bar per label, stacked by the keys of `stacks` (each a list aligned with `labels`)."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=FIGURE_SIZE)
    bottom = [0.0] * len(labels)
    positions = range(len(labels))
    for name, heights in stacks.items():
        axes.bar(positions, heights, bottom=bottom, label=name)
        bottom = [base + height for base, height in zip(bottom, heights)]
    axes.set_xticks(list(positions), labels, rotation=20, ha="right")
    _finish(plt, figure, axes, path, title, "", ylabel)


def scatter_plot(path: Path, title: str, xlabel: str, ylabel: str, points: dict[str, list[tuple[float, float, str]]],
                 y_range: tuple[float, float] | None = None) -> None:
    """Points (x, y, note) per series, each point annotated with its note."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=FIGURE_SIZE)
    if y_range is not None:
        axes.set_ylim(*y_range)
    for label, rows in points.items():
        axes.plot([x for x, _, _ in rows], [y for _, y, _ in rows], marker="o", linestyle="-", label=label)
        for x, y, note in rows:
            axes.annotate(note, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    _finish(plt, figure, axes, path, title, xlabel, ylabel)


def _finish(plt, figure, axes, path: Path, title: str, xlabel: str, ylabel: str, legend: bool = True) -> None:
    axes.set_title(title, fontsize=10)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    if legend and axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: never over data
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100, bbox_inches="tight", metadata={"Software": None})
    plt.close(figure)
