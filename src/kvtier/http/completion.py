"""One completion request end to end: route it, stream its choices' tokens into text, answer as JSON or SSE.

Both endpoints share this; they differ only in the shape of their bodies (shapes.py). A request
has `n` choices (`best_of` generated, the best `n` by cumulative log-probability returned), each
with its own text, stop strings and finish reason (choice.py). A stop string ends its choice at
once, and a client that goes away ends the request: it is aborted in its path, which frees its
KV (device blocks, swap slots) instead of generating tokens nobody will read. That holds from the
moment the request is submitted, which is only once its answer starts being produced: a client
gone before then (while its prompt was tokenized, say) never reaches a path; one gone while its
request is queued or prefilled is aborted there (counted as finished with reason "abort").
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtier.engine.sampling_params import SamplingParams
from kvtier.http.attention_budget import FIELD, BudgetUpdate, RequestBudget
from kvtier.http.backend import TIERED, Backend
from kvtier.http.choice import Choice
from kvtier.http.error_responses import APIError
from kvtier.http.logprobs import Entry
from kvtier.http.sampling import sampling_params
from kvtier.http.schemas import CompletionRequest, GenerationRequest
from kvtier.http.shapes import CHAT, COMPLETION, Reported, Shape
from kvtier.http.token_stream import Finished

__all__ = ["CHAT", "COMPLETION", "respond"]
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
CLIENT_CLOSED = 499  # the status (nginx's) logged for a non-streaming request whose client went away


async def respond(backend: Backend, shape: Shape, ids: list[int], body: GenerationRequest,
                  request: Request) -> Response:
    """Serve `body` (already tokenized to `ids`) and answer in `shape`; APIError before anything runs."""
    arrived = time.perf_counter()
    max_tokens = body.token_limit or min(backend.settings.default_max_tokens,
                                         max(1, backend.llm.context_length - len(ids)))
    path = backend.route(len(ids), max_tokens)
    sampling = sampling_params(body, max_tokens, backend.vocab_size, backend.grammars)
    if sampling.prompt_logprobs is not None and path == TIERED:
        raise APIError(400, "echo with logprobs is served for prompts that fit the device pool only: a longer "
                            "prompt's stored prefix never runs through the model", "echo", "unsupported_parameter")
    echo = None
    if isinstance(body, CompletionRequest) and body.echo:
        echo = body.prompt if isinstance(body.prompt, str) else backend.decode(ids)
    generation = Generation(backend, shape, path, ids, sampling, body.stop_strings, arrived, echo)
    if body.stream:
        return StreamingResponse(generation.events(body.include_usage), media_type="text/event-stream")
    answer = await generation.whole(request)
    return Response(status_code=CLIENT_CLOSED) if answer is None else JSONResponse(answer)


class Generation:
    """A routed request, submitted to its path when `deltas()` starts: its choices, token stream and metrics."""

    def __init__(self, backend: Backend, shape: Shape, path: str, ids: list[int], sampling: SamplingParams,
                 stop: list[str], arrived: float, echo: str | None = None) -> None:
        """`echo`: the prompt's text, put before each choice's text (completions' `echo`)."""
        self.backend, self.shape, self.path = backend, shape, path
        self.ids, self.sampling, self.echo = ids, sampling, echo
        self.prompt_tokens = len(ids)
        self.choices = [Choice(index, backend.decode, stop, sampling.min_tokens) for index in range(sampling.sequences)]
        self.prompt_entries: list[Entry] = []  # echo with logprobs: the prompt's tokens, the first with none
        self.budget = RequestBudget()  # tiered: what the sparse selection of its choices kept
        self.id = shape.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self._arrived = self._last = arrived
        self._tokens = 0

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self.choices)

    async def deltas(self) -> AsyncIterator[tuple[Choice, str, bool]]:
        """Submit the request, then yield (choice, its newly visible text, whether this ended it) as tokens come.

        Leaving early (the consumer is cancelled or closes the generator) aborts the request; a
        generator closed before it started has submitted nothing.
        """
        self.stream = self.backend.start(self.path, self.ids, self.sampling)
        try:
            while not self.finished:
                item = await self.stream.get()
                if isinstance(item, BudgetUpdate):
                    self.budget.update(item)
                    continue
                if isinstance(item, Finished):
                    for choice in self._ended_by(item):
                        yield choice, choice.end(item.reason), True
                    continue
                choice = self.choices[item.index]
                if choice.finished:  # stopped by a stop string; its abort is on its way
                    continue
                self._count_token()
                if item.prompt_logprobs is not None and not self.prompt_entries:
                    self.prompt_entries = [(self.ids[0], None)] + [(e.token_id, e) for e in item.prompt_logprobs]
                piece = choice.add(item)
                if choice.finished:
                    self.backend.cancel(self.stream, choice.index)
                    yield choice, piece + choice.end("stop"), True
                elif piece:
                    yield choice, piece, False
        finally:
            if not self.finished:  # the consumer went away (client disconnect): free the KV now
                self.backend.cancel(self.stream)
            else:
                self.backend.metrics.e2e.observe(time.perf_counter() - self._arrived)
            self.backend.metrics.finished.labels(self.choices[0].finish_reason or "abort").inc()

    async def whole(self, request: Request) -> dict[str, Any] | None:
        """The non-streaming body, or None when the client disconnected while it waited (the request is aborted)."""
        collect = asyncio.ensure_future(self._collect())
        try:
            while not collect.done():
                await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S)
                if not collect.done() and await request.is_disconnected():
                    return None
            collect.result()
        finally:
            collect.cancel()  # no-op once done; else the generator's `finally` aborts the request
        choices = [self.shape.choice(index, (self.echo or "") + choice.text.text, choice.finish_reason,
                                     self._logprobs(self.prompt_entries + choice.logprobs, Reported()))
                   for index, choice in enumerate(self._returned())]
        return self._envelope(self.shape.object) | {"choices": choices, "usage": self.usage()} | self.attention_budget()

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: chunks of each choice's text (the last with its finish reason), usage if asked,
        `[DONE]`. A tiered request's last chunk (the usage's, else the one that ends its last choice) carries its
        attention budget."""
        extra = {"usage": None} if include_usage else {}
        reported = [Reported() for _ in self.choices]
        started: set[int] = set()
        try:
            async for choice, piece, ended in self.deltas():
                first = choice.index not in started
                started.add(choice.index)
                text = (self.echo or "") + piece if first else piece
                entries = (self.prompt_entries if first else []) + choice.unreported()
                delta = self.shape.delta(choice.index, text, choice.finish_reason if ended else None,
                                         self._logprobs(entries, reported[choice.index]), first)
                last = {} if include_usage or not self.finished else self.attention_budget()
                yield _sse(self._chunk([delta]) | extra | last)
        except APIError as error:
            yield _sse(error.body())
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            yield _sse(self._chunk([]) | {"usage": self.usage()} | self.attention_budget())
        yield "data: [DONE]\n\n"

    def usage(self) -> dict[str, int]:
        completion = sum(choice.tokens for choice in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def attention_budget(self) -> dict[str, Any]:
        """A tiered request's `attention_budget` field (attention_budget.py); nothing for a paged one."""
        return {FIELD: self.budget.report()} if self.path == TIERED else {}

    async def _collect(self) -> None:
        async for _ in self.deltas():
            pass

    def _returned(self) -> list[Choice]:
        """The choices answered: all `n`, or the `n` of `best_of` with the highest cumulative log-probability."""
        if len(self.choices) == self.sampling.n:
            return self.choices
        return sorted(self.choices, key=lambda choice: -choice.cumulative_logprob)[:self.sampling.n]

    def _logprobs(self, entries: list[Entry], reported: Reported) -> dict[str, Any] | None:
        if self.sampling.logprobs is None:
            return None
        return self.shape.logprobs(entries, self.backend.token_text, reported)

    def _ended_by(self, item: Finished) -> list[Choice]:
        """The choices `item` ends (one, or every unfinished one); APIError when the request failed."""
        ended = [choice for choice in self.choices
                 if not choice.finished and (item.index is None or choice.index == item.index)]
        if item.reason == "error" or item.error:
            for choice in self.choices:
                choice.end(item.reason)
            status = 503 if item.reason == "abort" else 500
            raise APIError(status, item.error or "generation failed", code="generation_failed", kind="server_error")
        return ended

    def _count_token(self) -> None:
        now = time.perf_counter()
        metrics = self.backend.metrics
        (metrics.itl if self._tokens else metrics.ttft).observe(now - self._last)
        metrics.generation_tokens.inc()
        self._tokens += 1
        self._last = now

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.backend.settings.model_name}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return self._envelope(self.shape.chunk_object) | {"choices": choices}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
