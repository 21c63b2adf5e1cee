"""Log-probabilities in OpenAI's two shapes: the completions API's lists and the chat API's `content` entries.

Tokens are shown as the tokenizer decodes each one alone (special tokens included), as vLLM shows
them; the values are of the model's raw distribution (engine/logprobs.py). JSON has no -inf, so a
value below -9999 is sent as -9999, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.engine.logprobs import TokenLogprobs

FLOOR = -9999.0
Entry = tuple[int, TokenLogprobs | None]  # a token id, and its log-probabilities (None: the prompt's first token)


def completion_logprobs(entries: list[Entry], token_text: Callable[[int], str], offset: int
                        ) -> tuple[dict[str, Any], int]:
    """`{tokens, token_logprobs, top_logprobs, text_offset}` for `entries`, the first at character `offset`; and the
    offset after the last. Each top_logprobs dict holds the token itself and its top alternatives."""
    body: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, logprobs in entries:
        text = token_text(token_id)
        body["tokens"].append(text)
        body["text_offset"].append(offset)
        offset += len(text)
        if logprobs is None:
            body["token_logprobs"].append(None)
            body["top_logprobs"].append(None)
            continue
        body["token_logprobs"].append(_value(logprobs.logprob))
        alternatives = {token_text(token): _value(value) for token, value in logprobs.top}
        body["top_logprobs"].append({text: _value(logprobs.logprob)} | alternatives)
    return body, offset


def chat_logprobs(entries: list[Entry], token_text: Callable[[int], str]) -> dict[str, Any]:
    """`{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": None}`."""
    content = []
    for token_id, logprobs in entries:
        entry = _chat_token(token_text(token_id), logprobs.logprob)
        entry["top_logprobs"] = [_chat_token(token_text(token), value) for token, value in logprobs.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)
