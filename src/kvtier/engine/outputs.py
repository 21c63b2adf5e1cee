"""What the serving engine reports: each token as it is generated, and each finished choice of a request."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.engine.logprobs import TokenLogprobs


@dataclass(frozen=True)
class TokenEvent:
    """One token generated for choice `index` of a request in a step; `output` is set when that token finished the
    choice, and `done` when the request has no unfinished choice left."""

    request_id: int
    token_id: int | None  # None: the request ended without a new token (it could not start: `output` says why)
    output: RequestOutput | None = None
    queue_s: float | None = None  # with a request's first token: its wait from `add_request` to its first forward
    index: int = 0
    logprobs: TokenLogprobs | None = None  # when the request asked for them (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprobs] | None = None  # with a choice's first token, when asked
    done: bool = False


@dataclass
class RequestOutput:
    """A finished choice of a request: its tokens (and text when the engine has a tokenizer) and what happened to it."""

    request_id: int
    prompt_tokens: int
    token_ids: list[int]
    finish_reason: str
    text: str | None = None
    swap_outs: int = 0
    recomputes: int = 0
    warnings: list[str] = field(default_factory=list)
    tiered: bool = False  # its KV lived in tiers of its own (tiered.py)
    queue_s: float | None = None  # from `add_request` to the first forward that ran it (None: never ran)
    index: int = 0  # which choice of the request (SamplingParams.n, best_of)
    cumulative_logprob: float | None = None  # of its tokens (raw), when its sampling wanted them

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
