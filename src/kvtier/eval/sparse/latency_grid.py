"""The latency suite's experiments (the HillInfer paper, section 5) as grids of cells.

    a context   decode ms/token vs context length, every KV mode (paper Fig. 12/13)
    b batch     end-to-end latency vs batch size at 1920 input + 128 output tokens (InfiniGen's setting, Fig. 14),
                plus a stress run at batch 20-25 (Fig. 15)
    c ablation  prefetch baseline (`infinigen`; left out where no such mode exists), sparse without
                migration, +HKM (hit-table migration, fixed beta), +HKM+APP (beta from the latency model) (Fig. 16)
    d beta      sparse with fixed betas next to APP's beta (Fig. 16, right); the host budget holds the whole
                prompt here so that beta, not the host cap, sets the hot/cold split
    e alpha     importance rate 0.05-0.3 for every selective mode: latency and needle accuracy (Fig. 11)
    f traffic   bytes moved per decode step, per tier and direction, every KV mode

A Cell is one configuration measured `repeats` times; its key (kvtier.eval.record.cell_key)
names what varies, so a re-run skips it and a larger grid adds only new cells.
The fixed beta of the ablation defaults to alpha / (1 - alpha): a hot pool the size of the
importance rate, the guess a host without APP's latency model would make.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvtier.errors import ConfigError
from kvtier.eval.record import cell_key
from kvtier.kv_config import EXACT_MODES, KV_MODES

PREFETCH_BASELINE = "infinigen"  # the paper's "Prefetch-based" baseline (InfiniGen)
BETA_SWEEP_HOST_SHARE = 1.0  # host budget = the whole prompt KV: the cap M0 never decides the split
KEY_FIELDS = ("variant", "context", "batch", "alpha", "beta")
ABLATION_STEPS = ("prefetch", "sparse-no-migration", "hkm", "hkm-app")  # c's variants, in the paper's order


@dataclass(frozen=True)
class Experiment:
    letter: str
    name: str
    title: str


EXPERIMENTS = {e.letter: e for e in (
    Experiment("a", "context", "Decode latency vs context length"),
    Experiment("b", "batch", "Batch-size scaling (1920 input + 128 output tokens) and stress"),
    Experiment("c", "ablation", "Ablation: prefetch baseline, +HKM, +HKM+APP"),
    Experiment("d", "beta", "Beta sweep: measured latency minimum vs APP's beta"),
    Experiment("e", "alpha", "Alpha sweep: accuracy vs latency"),
    Experiment("f", "traffic", "Bytes moved per decode step, per tier and direction"),
)}


@dataclass(frozen=True)
class Grid:
    """Every size the experiments take; `--grid` picks a preset, options replace single fields."""

    name: str
    model: str
    contexts: tuple[int, ...]  # a
    new_tokens: int  # timed decode steps of a, c, d, e, f
    batches: tuple[int, ...]  # b
    stress_batches: tuple[int, ...]  # b
    stress_repeats: int | None  # b's stress cells run at most this often (None: --repeats)
    batch_input: int  # b
    batch_output: int  # b
    fixed_context: int  # c, d, e, f
    ablation_batch: int  # c
    betas: tuple[float, ...]  # d
    alphas: tuple[float, ...]  # e
    needle_depths: tuple[float, ...]  # e: accuracy cells per (mode, alpha) = depths x seeds
    needle_seeds: int
    alpha: float = 0.2  # the paper's importance rate, for every experiment but e
    fixed_beta: float | None = None  # c's +HKM beta; None: alpha / (1 - alpha)

    @property
    def ablation_beta(self) -> float:
        return self.fixed_beta if self.fixed_beta is not None else round(self.alpha / (1 - self.alpha), 4)


GRIDS = {
    "small": Grid("small", "smollm2-135m", contexts=(1024, 2048, 4096), new_tokens=8, batches=(1, 2, 4),
                  stress_batches=(20,), stress_repeats=1, batch_input=1920, batch_output=16, fixed_context=2048,
                  ablation_batch=1, betas=(0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0), alphas=(0.05, 0.1, 0.2, 0.3),
                  needle_depths=(0.25, 0.75), needle_seeds=1),
    "full": Grid("full", "qwen2.5-0.5b", contexts=(2048, 4096, 8192, 16384, 32512), new_tokens=32,
                 batches=tuple(range(1, 11)), stress_batches=tuple(range(20, 26)), stress_repeats=None,
                 batch_input=1920, batch_output=128, fixed_context=8192, ablation_batch=8,
                 betas=(0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0), alphas=(0.05, 0.1, 0.15, 0.2, 0.25, 0.3),
                 needle_depths=(0.1, 0.3, 0.5, 0.7, 0.9), needle_seeds=3),
}


@dataclass(frozen=True)
class Cell:
    """One configuration of one experiment, measured `repeats` times."""

    experiment: str
    variant: str  # what the cell runs: a KV mode, or an ablation step
    label: str  # how tables and plots name it
    mode: str
    context: int
    batch: int
    new_tokens: int
    repeats: int
    host_share: float
    alpha: float
    beta: str | float = "auto"
    policy: str | None = None  # sparse migration policy other than the default
    stress: bool = False
    needles: tuple[tuple[float, int], ...] = field(default=())  # (depth, seed) accuracy cells

    @property
    def key(self) -> str:
        return cell_key(**{name: getattr(self, name) for name in KEY_FIELDS})

    def params(self) -> dict:
        """The cell's coordinates as stored with its result."""
        return {name: getattr(self, name) for name in ("experiment", "variant", "label", "mode", "context", "batch",
                                                      "new_tokens", "host_share", "alpha", "beta", "policy", "stress")}


def experiment_cells(letter: str, grid: Grid, modes: tuple[str, ...], repeats: int, host_share: float) -> list[Cell]:
    """The cells of one experiment, modes innermost so that an interrupted run leaves comparable rows."""
    name = EXPERIMENTS[letter].name
    base = Cell(name, "", "", "", grid.fixed_context, 1, grid.new_tokens, repeats, host_share, grid.alpha)
    if letter == "a":
        return [_mode_cell(base, mode, context=context) for context in grid.contexts for mode in modes]
    if letter == "b":
        return _batch_cells(base, grid, modes)
    if letter == "c":
        return _ablation_cells(replace(base, batch=grid.ablation_batch), grid)
    if letter == "d":
        base = replace(base, host_share=BETA_SWEEP_HOST_SHARE)
        return [_mode_cell(base, "sparse", beta=beta, label=f"beta={beta}") for beta in (*grid.betas, "auto")]
    if letter == "e":
        return _alpha_cells(base, grid, modes)
    return [_mode_cell(base, mode) for mode in modes]


def _mode_cell(base: Cell, mode: str, label: str | None = None, **changes) -> Cell:
    return replace(base, variant=mode, label=label or mode, mode=mode, **changes)


def _batch_cells(base: Cell, grid: Grid, modes: tuple[str, ...]) -> list[Cell]:
    base = replace(base, context=grid.batch_input, new_tokens=grid.batch_output)
    stress_repeats = min(base.repeats, grid.stress_repeats or base.repeats)
    cells = [_mode_cell(base, mode, batch=batch) for batch in grid.batches for mode in modes]
    return cells + [_mode_cell(base, mode, batch=batch, stress=True, repeats=stress_repeats)
                    for batch in grid.stress_batches for mode in modes]


def _ablation_cells(base: Cell, grid: Grid) -> list[Cell]:
    """Prefetch baseline (when the mode exists), then sparse without HKM, +HKM, +HKM+APP."""
    beta = grid.ablation_beta
    cells = [replace(base, variant="prefetch", label=f"prefetch ({PREFETCH_BASELINE})", mode=PREFETCH_BASELINE)] \
        if PREFETCH_BASELINE in KV_MODES else []
    sparse = replace(base, mode="sparse")
    return cells + [
        replace(sparse, variant="sparse-no-migration", label=f"sparse, no migration (beta {beta})", beta=beta,
                policy="off"),
        replace(sparse, variant="hkm", label=f"+HKM (hit table, beta {beta})", beta=beta, policy="hit"),
        replace(sparse, variant="hkm-app", label="+HKM+APP (hit table, beta auto)", beta="auto", policy="hit"),
    ]


def _alpha_cells(base: Cell, grid: Grid, modes: tuple[str, ...]) -> list[Cell]:
    """Each selective mode at each alpha, and dense (alpha has no effect) as the accuracy reference."""
    needles = tuple((depth, seed) for seed in range(grid.needle_seeds) for depth in grid.needle_depths)
    base = replace(base, needles=needles)
    cells = [_mode_cell(base, "dense")] if "dense" in modes else []
    return cells + [_mode_cell(base, mode, alpha=alpha, label=f"{mode} alpha={alpha}")
                    for alpha in grid.alphas for mode in modes if mode not in EXACT_MODES]


def parse_experiments(text: str) -> tuple[str, ...]:
    """`a,c` or `context,ablation` -> ("a", "c"), in the order given."""
    by_name = {e.name: letter for letter, e in EXPERIMENTS.items()}
    letters = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        letter = item if item in EXPERIMENTS else by_name.get(item)
        if letter is None:
            known = ", ".join(f"{letter} ({e.name})" for letter, e in EXPERIMENTS.items())
            raise ConfigError(f"unknown experiment {item!r}; choose from {known}")
        letters.append(letter)
    if not letters:
        raise ConfigError("--experiments names no experiment")
    return tuple(dict.fromkeys(letters))


def parse_modes(text: str | None) -> tuple[str, ...]:
    """Comma-separated KV modes; None: every mode there is."""
    if text is None:
        return KV_MODES
    modes = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [mode for mode in modes if mode not in KV_MODES]
    if unknown or not modes:
        raise ConfigError(f"unknown KV mode {', '.join(unknown) or repr(text)}; choose from {', '.join(KV_MODES)}")
    return modes


def workload(cells: list[Cell]) -> tuple[int, int]:
    """(prompt tokens prefilled, decode steps run) over every repeat of `cells`: the size of a run."""
    prefill = sum(cell.repeats * cell.batch * cell.context + len(cell.needles) * cell.context for cell in cells)
    steps = sum(cell.repeats * (cell.new_tokens + 1) for cell in cells)
    return prefill, steps
