"""The continuous-batching engine stepping on a thread of its own, fed by the HTTP handlers.

The engine is not thread-safe, so only this thread touches it: handlers queue
commands (add a request, abort one or one of its choices, stop) and the thread
applies them between steps. Each generated token's event goes to its request's
`TokenStream`, and a `Finished` after each choice's last; a tiered choice's
token comes after its sparse cache's attention budget sums (a `BudgetUpdate`:
the server's tiered sequences are kvtier.tiered_kv's). When nothing is
running the thread sleeps on the command queue instead of spinning.

After every step, before handing out its tokens, the thread publishes an
`EngineSnapshot` (queue lengths, free blocks, swap traffic, the tiered sequences'
KV per tier), which /metrics reads
without reaching into the engine: a client that got its last token and then
scrapes sees the state after that step.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.errors import KvtierError
from kvtier.engine.serving_engine import LLMEngine
from kvtier.engine.sequence import SamplingParams
from kvtier.http.attention_budget import BudgetUpdate
from kvtier.http.token_stream import SHUTTING_DOWN, Finished, Item, TokenStream, deliver
from kvtier.kv.contract import TIERS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSnapshot:
    """What /metrics reports about the engine, taken on the engine thread after a step."""

    running: int
    waiting: int
    swapped: int
    device_blocks: int
    device_blocks_free: int
    block_bytes: int
    swap_backend: str  # "flash", "dram" or "recompute"
    swap_slots: int
    swap_slots_live: int
    swap_file_bytes: int  # the flash file's size on disk (0 for DRAM / recompute)
    swap_outs: int
    swap_ins: int
    swap_out_bytes: int
    swap_in_bytes: int
    preemptions: int
    recomputes: int
    tiered_sit_outs: int  # steps the tiered sequences sat out so that a short prompt went in alone
    tiered_running: int
    tiered_waiting: int
    tiered_kv_bytes: dict[str, int]  # summed over the running tiered sequences, per tier
    tiered_reserved_bytes: int  # the pool blocks reserved for their device windows
    tiered_counters: dict[str, int]  # the tier provider's totals so far (reads, scorer restarts, reuse)


def take_snapshot(engine: LLMEngine) -> EngineSnapshot:
    scheduler, swap = engine.scheduler, engine.swap
    file = getattr(swap, "file", None)
    tiered = scheduler.tiered_running()
    kv_bytes = dict.fromkeys(TIERS, 0)
    for seq in tiered:
        for tier, count in seq.kv.tier_bytes().items():
            kv_bytes[tier] += count
    return EngineSnapshot(
        running=len(scheduler.running) - len(tiered), waiting=sum(not seq.tiered for seq in scheduler.waiting),
        tiered_running=len(tiered), tiered_waiting=sum(seq.tiered for seq in scheduler.waiting),
        tiered_kv_bytes=kv_bytes, tiered_reserved_bytes=engine.tiers.budgets.device_bytes * len(tiered) if tiered else 0,
        tiered_counters=engine.tiers.provider.counters() if engine.tiers else {},
        swapped=len(scheduler.swapped) + len(scheduler.swapping_out),
        device_blocks=engine.block_manager.num_blocks, device_blocks_free=engine.block_manager.num_free,
        block_bytes=engine.pool.nbytes // engine.pool.num_blocks,
        swap_backend=engine.config.swap, swap_slots=swap.num_slots if swap else 0,
        swap_slots_live=swap.allocator.live if swap else 0,
        swap_file_bytes=os.path.getsize(file.path) if file is not None else 0,
        swap_outs=scheduler.stats.swap_outs, swap_ins=scheduler.stats.swap_ins,
        swap_out_bytes=swap.stats.out_bytes if swap else 0, swap_in_bytes=swap.stats.in_bytes if swap else 0,
        preemptions=scheduler.stats.preemptions, recomputes=scheduler.stats.recomputes,
        tiered_sit_outs=scheduler.stats.tiered_sit_outs)


class EngineLoop:
    """Runs `engine` on a daemon thread until `stop()`; the caller closes the engine afterwards."""

    def __init__(self, engine: LLMEngine, on_queue_time: Callable[[float], None] = lambda seconds: None) -> None:
        """`on_queue_time(seconds)`: each request's wait from arrival to its first forward, told with its first token."""
        self.engine = engine
        self._on_queue_time = on_queue_time
        self.snapshot = take_snapshot(engine)
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[int, TokenStream] = {}
        self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, stream: TokenStream) -> None:
        self._commands.put(("add", prompt_ids, sampling, stream))

    def abort(self, stream: TokenStream, index: int | None = None) -> None:
        """End the stream's request, or its choice `index` (its tokens stop, its blocks are freed); safe to call more
        than once. A whole request's stream ends with Finished("abort"); a choice ends silently (its caller knows)."""
        self._commands.put(("abort", stream, index))

    def stop(self, wait: bool = True) -> None:
        """Fail every unfinished request ("abort", with a message), then end the thread (`wait`: and join it)."""
        self._commands.put(("stop",))
        if wait:
            self._thread.join()

    # ----- the engine thread -----

    def _run(self) -> None:
        while True:
            idle = not self.engine.has_unfinished()
            if not self._apply(self._commands.get() if idle else None):
                return
            if not self._drain():
                return
            if self.engine.has_unfinished():
                self._step()
            else:  # only commands ran (e.g. aborts): the step did not take a snapshot
                self.snapshot = take_snapshot(self.engine)

    def _drain(self) -> bool:
        """Apply every queued command; False once `stop` was among them."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if not self._apply(command):
                return False

    def _apply(self, command: tuple | None) -> bool:
        if command is None:
            return True
        kind, *args = command
        if kind == "add":
            self._add(*args)
        elif kind == "abort" and args[1] is not None:
            self._abort_choice(*args)
        elif kind == "abort":
            self._abort(args[0], "abort")
        else:
            for stream in list(self._streams.values()):
                self._abort(stream, "abort", SHUTTING_DOWN)
            self.snapshot = take_snapshot(self.engine)
            return False
        return True

    def _add(self, prompt_ids: list[int], sampling: SamplingParams, stream: TokenStream) -> None:
        if stream.cancelled:  # the client left before its request reached the engine
            stream.finish("abort")
            return
        try:
            stream.request_id = self.engine.add_request(prompt_ids, sampling)
        except KvtierError as error:  # the front end checks sizes first; this is the engine's last word
            stream.finish("error", str(error))
            return
        self._streams[stream.request_id] = stream

    def _abort(self, stream: TokenStream, reason: str, error: str | None = None) -> None:
        if stream.request_id is None or self._streams.pop(stream.request_id, None) is None:
            return  # never added, or already finished
        self.engine.abort(stream.request_id)
        stream.finish(reason, error)

    def _abort_choice(self, stream: TokenStream, index: int) -> None:
        if stream.request_id is None or stream.request_id not in self._streams:
            return
        self.engine.abort(stream.request_id, index)
        if not self.engine.choices.members(stream.request_id):  # it was the last choice left
            self._abort(stream, "abort")

    def _step(self) -> None:
        tiered = {(seq.group, seq.index): seq.kv for seq in self.engine.scheduler.tiered_running()}
        try:
            events = self.engine.step_events()
        except Exception as error:  # an engine bug must not take the server down: fail what was in flight
            log.exception("engine step failed; failing %d requests", len(self._streams))
            for stream in list(self._streams.values()):
                self._abort(stream, "error", f"engine step failed: {error}")
            self.snapshot = take_snapshot(self.engine)
            return
        self.snapshot = take_snapshot(self.engine)  # before any client hears of this step's results
        items: list[tuple[TokenStream, Item]] = []
        for event in events:
            stream = self._streams[event.request_id]
            kv = tiered.get((event.request_id, event.index))
            if event.token_id is not None and kv is not None:  # its KV closes when it ends: held from before the step
                items.append((stream, BudgetUpdate(event.index, kv.budget_totals())))
            if event.token_id is not None:
                items.append((stream, event))
            if event.queue_s is not None:
                self._on_queue_time(event.queue_s)
            if event.output is not None:
                output = event.output
                error = "; ".join(output.warnings) if output.finish_reason == "error" else None
                items.append((stream, Finished(output.finish_reason, error, output.index)))
            if event.done:
                del self._streams[event.request_id]
        deliver(items)
