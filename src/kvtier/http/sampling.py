"""A request body -> the engine's SamplingParams, as vLLM's OpenAI server maps one onto the other.

A field the client leaves out (or sends as null) takes vLLM's default; OpenAI's default temperature
is 1. The values are checked by SamplingParams, and its error becomes a 400 naming the request's
field. `response_format` becomes a compiled grammar (engine/grammar.py): a schema that cannot be
compiled is a 400 saying why.
"""

from __future__ import annotations

from typing import Any

from kvtier.engine.grammar import GrammarCompiler, GrammarError
from kvtier.engine.sampling_params import SamplingError, SamplingParams
from kvtier.http.error_responses import APIError
from kvtier.http.schemas import CompletionRequest, GenerationRequest

DEFAULT_TEMPERATURE = 1.0  # OpenAI's
# The request's names for SamplingParams fields named otherwise.
REQUEST_NAMES = {"max_new_tokens": "max_tokens", "prompt_logprobs": "logprobs"}
OPTIONAL = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens")


def sampling_params(body: GenerationRequest, max_tokens: int, vocab_size: int,
                    grammars: GrammarCompiler) -> SamplingParams:
    """The engine's sampling for `body`, generating at most `max_tokens` tokens; APIError naming a bad field."""
    fields: dict[str, Any] = {name: getattr(body, name) for name in OPTIONAL if getattr(body, name) is not None}
    echo_logprobs = isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None
    try:
        return SamplingParams(
            max_new_tokens=max_tokens, ignore_eos=body.ignore_eos, seed=body.seed,
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            stop_token_ids=tuple(_token_ids(body.stop_token_ids or [], vocab_size, "stop_token_ids")),
            logit_bias=_bias(body.logit_bias or {}, vocab_size), logprobs=body.reported_logprobs,
            prompt_logprobs=body.logprobs if echo_logprobs else None, n=body.choices,
            best_of=getattr(body, "best_of", None), grammar=_grammar(body, grammars), **fields)
    except SamplingError as error:
        param = REQUEST_NAMES.get(error.field, error.field)
        raise APIError(400, f"invalid value for {param!r}: {str(error).removeprefix(error.field + ' ')}", param,
                       "invalid_value") from None


def _token_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    if any(not 0 <= token < vocab_size for token in ids):
        raise APIError(400, f"token ids in {param} must be in [0, {vocab_size})", param, "invalid_value")
    return ids


def _bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    return dict(zip(_token_ids([int(key) for key in bias], vocab_size, "logit_bias"), bias.values()))


def _grammar(body: GenerationRequest, grammars: GrammarCompiler) -> Any:
    """The compiled grammar `response_format` asks for, or None for none (or "text")."""
    form = body.response_format
    if form is None or form.type == "text":
        return None
    try:
        if form.type == "json_object":
            return grammars.json_object()
        return grammars.json_schema(form.json_schema.json_schema)
    except GrammarError as error:
        raise APIError(400, f"invalid value for 'response_format': {error}", "response_format",
                       "invalid_value") from None
