"""One request as the engine sees it: its tokens, where its KV lives, and how it should be sampled.

A sequence moves through these states (scheduler.py drives every transition):

    WAITING --admit--> RUNNING --finish--> FINISHED
       ^                 |  ^
       |  recompute      |  | swap in (synchronous, before its next step)
       +-----------------+  |
                  swap out  |
    RUNNING --> SWAPPING_OUT --write done--> SWAPPED
                  (blocks still pinned on the device while the write is in flight)

    any state --abort--> FINISHED (finish_reason "abort"; its device blocks and swap slots freed)

A tiered sequence (tiered.py) takes the same path without swapping: admitted, it opens its tiered
KV; finished or aborted, it closes it.

`num_computed` counts the leading tokens whose K/V sit in the device pool (a tiered sequence: in its KV). A
prefill runs the not-yet-computed tokens in chunks; a decode step runs exactly
one token (the last one sampled). Recompute sets `num_computed` back to 0 and
keeps the generated tokens, so the sequence resumes where it stopped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvtier.engine.logprobs import TokenLogprobs
    from kvtier.engine.tiered import SequenceKV

__all__ = ["SamplingParams", "Sequence", "Status"]  # SamplingParams lives in sampling_params.py; callers find it here


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPING_OUT = "swapping_out"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class Sequence:
    """Tokens, block table and swap location of one request."""

    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    swap_slots: list[int] = field(default_factory=list)  # where the swapped-out blocks wait, in block order
    num_computed: int = 0
    finish_reason: str | None = None
    swap_outs: int = 0
    recomputes: int = 0
    warnings: list[str] = field(default_factory=list)  # recovered errors, e.g. a corrupted swap block
    tiered: bool = False  # its KV outgrows the paged pool: it lives in tiers of its own (tiered.py)
    kv: SequenceKV | None = None  # a running tiered sequence's KV; its block table is then its device reservation
    arrived_s: float = 0.0  # perf_counter at `add_request`
    started_s: float | None = None  # perf_counter after its first forward
    group: int = -1  # the request it is a choice of (its caller's id); -1: its own `request_id`
    index: int = 0  # which choice of that request
    forks: int = 0  # choices still to fork from it once its prompt is computed (they share its prompt's blocks)
    cumulative_logprob: float = 0.0  # of its generated tokens, when its sampling wants them
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # the prompt's tokens after the first, when asked

    def __post_init__(self) -> None:
        if self.group < 0:
            self.group = self.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_tokens(self) -> int:
        """Tokens the sequence can reach: the KV it may ever need."""
        return len(self.prompt_ids) + self.sampling.max_new_tokens

    @property
    def prompt_computed(self) -> bool:
        """Every prompt token's K/V is computed (again, after a recompute): the sequence decodes."""
        return self.num_computed >= len(self.prompt_ids)

    def pending_tokens(self) -> int:
        """Tokens whose K/V still has to be computed before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    def reset_for_recompute(self) -> None:
        """Forget the KV (dropped or unreadable); keep the tokens so the output continues unchanged."""
        self.block_table = []
        self.swap_slots = []
        self.num_computed = 0
        self.recomputes += 1
        self.status = Status.WAITING
