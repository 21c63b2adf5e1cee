"""One completion request end to end: route it, stream its tokens into text, answer as JSON or SSE.

Both endpoints share this; they differ only in the shape of their bodies (`Shape`). A stop string
or a client that goes away ends generation at once: the request is aborted in its path, which
frees its KV (device blocks, swap slots) instead of generating tokens nobody will read. That
holds from the moment the request is submitted, which is only once its answer starts being
produced: a client gone before then (while its prompt was tokenized, say) never reaches a path;
one gone while its request is queued or prefilled is aborted there (counted as finished with
reason "abort").
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtier.errors import ConfigError
from kvtier.engine.sequence import SamplingParams
from kvtier.http.backend import Backend
from kvtier.http.error_responses import APIError
from kvtier.http.schemas import GenerationRequest
from kvtier.http.text import TextAssembler
from kvtier.http.token_stream import Finished

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
CLIENT_CLOSED = 499  # the status (nginx's) logged for a non-streaming request whose client went away


@dataclass(frozen=True)
class Shape:
    """How one endpoint's bodies look."""

    object: str
    chunk_object: str
    id_prefix: str
    chat: bool

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": finish_reason}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def delta(self, text: str, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        if not self.chat:
            return self.choice(text, finish_reason)
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


COMPLETION = Shape("text_completion", "text_completion", "cmpl-", chat=False)
CHAT = Shape("chat.completion", "chat.completion.chunk", "chatcmpl-", chat=True)


async def respond(backend: Backend, shape: Shape, ids: list[int], body: GenerationRequest,
                  request: Request) -> Response:
    """Serve `body` (already tokenized to `ids`) and answer in `shape`; APIError before anything runs."""
    arrived = time.perf_counter()
    max_tokens = body.token_limit or min(backend.settings.default_max_tokens,
                                         max(1, backend.llm.context_length - len(ids)))
    path = backend.route(len(ids), max_tokens)
    try:
        sampling = SamplingParams(max_new_tokens=max_tokens, ignore_eos=body.ignore_eos,
                                  temperature=body.temperature, top_p=body.top_p, seed=body.seed)
    except ConfigError as error:
        raise APIError(400, str(error)) from None
    generation = Generation(backend, shape, path, ids, sampling, body.stop_strings, arrived)
    if body.stream:
        return StreamingResponse(generation.events(body.include_usage), media_type="text/event-stream")
    answer = await generation.whole(request)
    return Response(status_code=CLIENT_CLOSED) if answer is None else JSONResponse(answer)


class Generation:
    """A routed request, submitted to its path when `pieces()` starts: its token stream, its text, its metrics."""

    def __init__(self, backend: Backend, shape: Shape, path: str, ids: list[int], sampling: SamplingParams,
                 stop: list[str], arrived: float) -> None:
        self.backend, self.shape, self.path = backend, shape, path
        self.ids, self.sampling = ids, sampling
        self.prompt_tokens = len(ids)
        self.text = TextAssembler(backend.decode, stop)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.id = shape.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self._arrived = self._last = arrived

    async def pieces(self) -> AsyncIterator[str]:
        """Submit the request, then yield its visible text piece by piece; `finish_reason` is set when it ends.

        Leaving early (the consumer is cancelled or closes the generator) aborts the request; a
        generator closed before it started has submitted nothing.
        """
        self.stream = self.backend.start(self.path, self.ids, self.sampling)
        try:
            while self.finish_reason is None:
                item = await self.stream.get()
                if isinstance(item, Finished):
                    self._finished(item)
                    break
                self._count_token()
                piece = self.text.add(item)
                if piece:
                    yield piece
                if self.text.stopped:
                    self.backend.cancel(self.stream)
                    self.finish_reason = "stop"
            tail = self.text.finish()
            if tail:
                yield tail
        finally:
            if self.finish_reason is None:  # the consumer went away (client disconnect): free the KV now
                self.backend.cancel(self.stream)
            else:
                self.backend.metrics.e2e.observe(time.perf_counter() - self._arrived)
            self.backend.metrics.finished.labels(self.finish_reason or "abort").inc()

    async def whole(self, request: Request) -> dict[str, Any] | None:
        """The non-streaming body, or None when the client disconnected while it waited (the request is aborted)."""
        collect = asyncio.ensure_future(self._collect())
        try:
            while not collect.done():
                await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S)
                if not collect.done() and await request.is_disconnected():
                    return None
            text = collect.result()
        finally:
            collect.cancel()  # no-op once done; else the generator's `finally` aborts the request
        return self._envelope(self.shape.object) | {"choices": [self.shape.choice(text, self.finish_reason)],
                                                     "usage": self.usage()}

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: one chunk per text piece, the finishing chunk, usage if asked, `[DONE]`."""
        extra = {"usage": None} if include_usage else {}
        first = True
        try:
            async for piece in self.pieces():
                yield _sse(self._chunk([self.shape.delta(piece, None, first)]) | extra)
                first = False
        except APIError as error:
            yield _sse(error.body())
            yield "data: [DONE]\n\n"
            return
        yield _sse(self._chunk([self.shape.delta("", self.finish_reason, first)]) | extra)
        if include_usage:
            yield _sse(self._chunk([]) | {"usage": self.usage()})
        yield "data: [DONE]\n\n"

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    async def _collect(self) -> str:
        async for _ in self.pieces():
            pass
        return self.text.text

    def _finished(self, item: Finished) -> None:
        self.finish_reason = item.reason
        if item.reason == "error" or item.error:
            status = 503 if item.reason == "abort" else 500
            raise APIError(status, item.error or "generation failed", code="generation_failed", kind="server_error")

    def _count_token(self) -> None:
        now = time.perf_counter()
        metrics = self.backend.metrics
        (metrics.itl if self.completion_tokens else metrics.ttft).observe(now - self._last)
        metrics.generation_tokens.inc()
        self.completion_tokens += 1
        self._last = now

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.backend.settings.model_name}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return self._envelope(self.shape.chunk_object) | {"choices": choices}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
