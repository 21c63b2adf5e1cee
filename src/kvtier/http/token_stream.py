"""A request's tokens handed from the thread that generates them to the asyncio task that answers it."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from kvtier.engine.outputs import TokenEvent
from kvtier.http.attention_budget import BudgetUpdate

SHUTTING_DOWN = "the server is shutting down"  # why requests still unfinished at shutdown failed


@dataclass(frozen=True)
class Finished:
    """Why choice `index` of the request ended (None: every choice left), and the error message when it failed."""

    reason: str  # "stop", "length", "abort" or "error"
    error: str | None = None
    index: int | None = None


Item = TokenEvent | Finished | BudgetUpdate  # what a stream carries (BudgetUpdate: before a tiered choice's token)


class TokenStream:
    """The engine's token events (a `Finished` after each choice's last) pushed from any thread, awaited on the event
    loop that made it.

    `cancel()` (the client went away, or a stop string matched) is seen by the producing thread
    through `cancelled`; it then stops generating and pushes `Finished("abort")`.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.request_id: int | None = None  # the engine's id, set on the engine thread

    def push(self, event: TokenEvent) -> None:
        self._put(event)

    def finish(self, reason: str, error: str | None = None, index: int | None = None) -> None:
        self._put(Finished(reason, error, index))

    async def get(self) -> Item:
        return await self._queue.get()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _put(self, item: Item) -> None:
        deliver([(self, item)])


def deliver(items: list[tuple[TokenStream, Item]]) -> None:
    """Hand many items to their streams with one wake-up per event loop.

    An engine step yields a token for every running request; waking the event loop once per token
    made the loop thread compete with the engine thread for the interpreter 64 times a step.
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[TokenStream, Item]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream._loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the event loop already closed (server shut down): nobody is listening
            pass


def _put_all(batch: list[tuple[TokenStream, Item]]) -> None:
    for stream, item in batch:
        stream._queue.put_nowait(item)
