"""Every knob of the sparse path in one validated dataclass (the CLI exposes the main ones via KVConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import ConfigError, setting
from kvtier.sparse.hot.migration import POLICIES
from kvtier.sparse.cold.sketch import AGGREGATIONS, SCORE_BITS


DEFAULT_TOP_P = 0.9  # `--alpha auto`'s attention mass (docs/decisions.md: chosen from the RULER-style suite)


@dataclass(frozen=True)
class SparseSettings:
    """HillInfer parameters. Tokens counts are per layer and sequence."""

    alpha: float = 0.2  # importance rate: fraction of pooled (hot + cold) tokens attended per step (paper: 20%)
    # Adaptive budget (mass.py): with `top_p` set, each layer and step keeps the fewest tokens whose estimated
    # attention mass reaches it, between `min_share` and `max_share` of the pooled tokens; where the mass at that
    # count is under `guard_mass`, the ceiling is lifted (up to every token scored). alpha then only plans (APP).
    top_p: float | None = None
    min_share: float = 0.02
    max_share: float = 0.3
    guard_mass: float = 0.6
    score_bits: int = 4  # sketch precision: they only draw up the cold shortlist, exact scores choose
    beta: float | None = None  # hot/cold split Mc/Ms; None: APP chooses it (planner.py)
    sink: int = 4  # first tokens always attended (attention sinks): the first holds their mass, 4 insure others
    recent: int = 64  # last tokens always attended, kept on the device with the new ones; the attention mass's knee
    # GQA token importance: summed group queries ("sum") or max over heads ("max"); sum keeps as much attention
    # mass and sends and scores one query per KV head instead of one per query head
    aggregation: str = "sum"
    observation_window: int = 32  # last prompt queries whose attention places tokens hot or cold (SnapKV-style)
    policy: str = "hit"  # migration: hit table ("hit"), instantaneous scores ("naive"), none ("off")
    max_moves: int = 8  # promotions (swaps) per layer, sequence and step
    promote_hits: int = 2
    idle_steps: int = 16
    demote_batch: int = 64  # tokens per sequence demoted at once when the hot pool overflows (batched writes)
    # Tokens leave the recent window for the hot pool this many at a time, so the window holds recent to
    # recent + retire_batch - 1 tokens (all attended); moving them one per step cost ~0.3 ms per layer and step.
    retire_batch: int = 16
    scorer_memory_budget: int = 0  # bytes of sketches the scorer may keep in memory (emulated on-board DRAM)
    scorer_io_threads: int = 4
    # Tokens per streamed score block. Each block is one numpy call in the scorer, so small blocks pay call
    # overhead; 1024 keeps streaming (an 8K layer is several blocks) at near the one-piece cost.
    score_block_tokens: int = 1024
    # Cold tokens are chosen by exact q.k from a shortlist the sketches draw up (selection.py): `candidate_margin`
    # x the cold tokens the sketch scores would pick, or, with the lookahead, x the layer's last cold picks.
    candidate_margin: float = 1.5
    # Lookahead (lookahead.py): score and read a layer's cold candidates with its query predicted from the
    # previous layer's input; the first `lookahead_skip` tiered layers are not predicted but asked for a step
    # ahead, with the query they attended with at the step before; neither is done for layers with fewer than
    # `lookahead_min_cold` cold tokens per sequence (there it costs about what it hides).
    lookahead: bool = True
    lookahead_skip: int = 2
    lookahead_min_cold: int = 256
    crash_scorer_after_blocks: int = -1  # fault injection for tests: the scorer kills itself after that many blocks

    def validated(self) -> SparseSettings:
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError(f"{setting('alpha')} must be in (0, 1], got {self.alpha}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0 and 0.0 <= self.min_share <= self.max_share <= 1.0
                                           and 0.0 <= self.guard_mass <= self.top_p):
            raise ConfigError(f"{setting('top_p')} must be in (0, 1], 0 <= min_share <= max_share <= 1 and "
                              f"0 <= guard_mass <= top_p, got {self.top_p}, {self.min_share}, {self.max_share} and "
                              f"{self.guard_mass}")
        if self.score_bits not in SCORE_BITS:
            raise ConfigError(f"{setting('score_bits')} must be one of {', '.join(map(str, SCORE_BITS))}, got {self.score_bits}")
        if self.beta is not None and self.beta < 0:
            raise ConfigError(f"{setting('beta')} must be 'auto' or a non-negative number, got {self.beta}")
        if self.sink < 0 or self.recent < 1:
            raise ConfigError(f"{setting('sink')} must be >= 0 and {setting('recent')} >= 1, got {self.sink} and {self.recent}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"migration policy must be one of {POLICIES}, got {self.policy!r}")
        if min(self.observation_window, self.demote_batch, self.score_block_tokens, self.retire_batch) < 1 \
                or self.max_moves < 0:
            raise ConfigError("observation_window, demote_batch, score_block_tokens and retire_batch must be >= 1, "
                              "max_moves >= 0")
        if self.candidate_margin < 1.0 or min(self.lookahead_skip, self.lookahead_min_cold) < 1:
            raise ConfigError(f"candidate_margin must be >= 1, lookahead_skip and lookahead_min_cold >= 1, got "
                              f"{self.candidate_margin}, {self.lookahead_skip} and {self.lookahead_min_cold}")
        return self


    @property
    def most_share(self) -> float:
        """The largest share of the pooled tokens a step plans to attend (the guard aside)."""
        return self.alpha if self.top_p is None else max(self.alpha, self.max_share)


def parse_beta(text: str | float | None) -> float | None:
    """`auto` (None) or a non-negative float, from the CLI/KVConfig form."""
    if text is None or (isinstance(text, str) and text.strip().lower() == "auto"):
        return None
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{setting('beta')} must be 'auto' or a number, got {text!r}") from None
