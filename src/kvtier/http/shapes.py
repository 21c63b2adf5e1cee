"""How each endpoint's bodies look: a whole answer's choices, a streamed chunk's deltas, their log-probabilities."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.http.logprobs import Entry, chat_logprobs, completion_logprobs


@dataclass
class Reported:
    """Where a choice's reported log-probabilities stand: the completions API counts characters across chunks."""

    offset: int = 0


@dataclass(frozen=True)
class Shape:
    """One endpoint's body shapes."""

    object: str
    chunk_object: str
    id_prefix: str
    chat: bool

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
               ) -> dict[str, Any]:
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta(self, index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None,
              first: bool = False) -> dict[str, Any]:
        if not self.chat:
            return self.choice(index, text, finish_reason, logprobs)
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(self, entries: list[Entry], token_text: Callable[[int], str], reported: Reported
                 ) -> dict[str, Any]:
        """`entries` in this endpoint's shape (the completions API's text offsets continue from `reported`)."""
        if self.chat:
            return chat_logprobs(entries, token_text)
        body, reported.offset = completion_logprobs(entries, token_text, reported.offset)
        return body


COMPLETION = Shape("text_completion", "text_completion", "cmpl-", chat=False)
CHAT = Shape("chat.completion", "chat.completion.chunk", "chatcmpl-", chat=True)
