"""One choice of a request as its client sees it: visible text, token count, log-probabilities, why it ended."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.engine.outputs import TokenEvent
from kvtier.http.logprobs import Entry
from kvtier.http.text import TextAssembler


class Choice:
    """Feed the engine's events for choice `index` with `add`; `finish_reason` is set once it ended.

    A stop string ends it here (the caller then aborts it in the engine); events that still arrive
    for it afterwards are dropped. `logprobs` keeps every token's entry; `unreported()` hands the
    ones a stream has not sent yet.
    """

    def __init__(self, index: int, decode: Callable[[list[int]], str], stop: list[str], min_tokens: int = 0) -> None:
        self.index = index
        self.text = TextAssembler(decode, stop, min_tokens)
        self.tokens = 0
        self.finish_reason: str | None = None
        self.logprobs: list[Entry] = []
        self.cumulative_logprob = 0.0
        self._reported = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, event: TokenEvent) -> str:
        """The choice's next token: returns the text it makes visible."""
        if self.finished:
            return ""
        self.tokens += 1
        if event.logprobs is not None:
            self.logprobs.append((event.token_id, event.logprobs))
            self.cumulative_logprob += event.logprobs.logprob
        piece = self.text.add(event.token_id)
        if self.text.stopped:
            self.finish_reason = "stop"
        return piece

    def end(self, reason: str) -> str:
        """The engine ended the choice (unless a stop string did first): returns the text held back until now."""
        if not self.finished:
            self.finish_reason = reason
        return self.text.finish()

    def unreported(self) -> list[Entry]:
        entries = self.logprobs[self._reported:]
        self._reported = len(self.logprobs)
        return entries
