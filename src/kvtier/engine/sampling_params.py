"""How one request is decoded: limits, vLLM's sampling parameters, log-probabilities, choices and a grammar.

The fields and their meanings follow vLLM's `SamplingParams` (the OpenAI server maps request
fields onto them one to one), so a client tuned against vLLM gets the same decoding here. Every
value is checked when the object is made: a `SamplingError` names the field (the server answers it
as a 400 with that `param`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.errors import ConfigError

MAX_LOGPROBS = 20  # vLLM's default max_logprobs: top alternatives per token
MAX_CHOICES = 128  # OpenAI's limit on n (and so on best_of)
MAX_LOGIT_BIAS = 100.0  # OpenAI clamps a bias to [-100, 100]


class SamplingError(ConfigError):
    """A sampling value that cannot work; `field` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name} {message}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    """Decoding limits and sampling of one request (vLLM's names and defaults).

    `temperature` 0 is greedy: the argmax of the processed logits, which are the raw logits
    themselves unless a penalty, `logit_bias`, `min_tokens` or a grammar applies. Above 0 the next
    token is drawn from softmax(logits / temperature) restricted by `top_k` (-1 or 0: off), `top_p`
    (the smallest set reaching that mass) and `min_p` (tokens below min_p x the top probability
    dropped); a `seed` fixes the draws (choice i of a request uses seed + i). Before sampling,
    greedy or not: `repetition_penalty` divides a positive logit (multiplies a negative one) of every
    token seen in the prompt or the output, `presence_penalty` and `frequency_penalty` subtract from
    tokens seen in the output (once, and per occurrence), `logit_bias` adds per token id, and until
    `min_tokens` tokens exist the end-of-sequence and `stop_token_ids` tokens cannot be drawn.

    Generation stops at `max_new_tokens`, at end-of-sequence (unless `ignore_eos`), at a token of
    `stop_token_ids`, or when `grammar` is complete. `logprobs`: report the log-probability of each
    generated token and of its `logprobs` most likely alternatives; `prompt_logprobs` the same for
    the prompt's tokens (both from the model's raw distribution, before temperature and penalties).
    `n` choices are returned of `best_of` (default n) generated, the best by cumulative log-probability.
    Higher `priority` is preempted later (ties: least recently run first).
    """

    max_new_tokens: int = 64
    priority: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None
    grammar: Any = None  # a compiled grammar (kvtier.engine.grammar): the output must match it

    def __post_init__(self) -> None:
        _integer("max_new_tokens", self.max_new_tokens, 1)
        _number("temperature", self.temperature, 0, math.inf)
        if not 0 < self.top_p <= 1:
            raise SamplingError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not (self.top_k >= 1 or self.top_k in (0, -1)):
            raise SamplingError("top_k", f"must be -1 or 0 (off) or at least 1, got {self.top_k!r}")
        _number("min_p", self.min_p, 0, 1)
        if not self.repetition_penalty > 0 or math.isinf(self.repetition_penalty):
            raise SamplingError("repetition_penalty", f"must be above 0, got {self.repetition_penalty!r}")
        _number("presence_penalty", self.presence_penalty, -2, 2)
        _number("frequency_penalty", self.frequency_penalty, -2, 2)
        if self.seed is not None:
            _integer("seed", self.seed, -2 ** 63)
        for token in self.stop_token_ids:
            _integer("stop_token_ids", token, 0)
        _integer("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_new_tokens:
            raise SamplingError("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_new_tokens})")
        self._check_bias()
        self._check_choices()
        if self.grammar is not None and self.min_tokens:
            raise SamplingError("min_tokens", "cannot be combined with a structured output: a grammar may only allow "
                                              "its end")

    def _check_bias(self) -> None:
        for token, bias in self.logit_bias.items():
            _integer("logit_bias", token, 0)
            _number("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)

    def _check_choices(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _integer(name, value, 0, MAX_LOGPROBS)
        _integer("n", self.n, 1, MAX_CHOICES)
        if self.best_of is not None:
            _integer("best_of", self.best_of, self.n, MAX_CHOICES)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def sequences(self) -> int:
        """Sequences generated for the request: `best_of`, or `n`."""
        return self.best_of or self.n

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def wants_logprob(self) -> bool:
        """Whether each generated token's log-probability is needed (reported, or to rank `best_of` choices)."""
        return self.logprobs is not None or self.sequences > self.n

    def for_choice(self, index: int) -> SamplingParams:
        """The sampling of choice `index` of a request: its own seed (seed + index), so choices differ."""
        if index == 0 or self.seed is None:
            return self
        return replace(self, seed=self.seed + index)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(name: str, value: Any, low: int, high: int | None = None) -> None:
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f"at least {low}"
        raise SamplingError(name, f"must be an integer {bound}, got {value!r}")


def _number(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        bound = f"at least {low}" if math.isinf(high) else f"in [{low}, {high}]"
        raise SamplingError(name, f"must be {bound}, got {value!r}")
