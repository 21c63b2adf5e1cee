"""Torch threads per phase: prefill on every core; a scorer mode's decode yields a core to the scorer process.

The sparse path's storage scorer is a process of its own that works during decode and needs a
core (`scorer_core`): the scorer pins itself to it, and a scorer mode's decode keeps the decoding
thread off it. Unpinned, a pipe write tends to run the woken reader on the writer's core (a
synchronous wake-up), where scorer and decoding thread take turns while the other core idles.

Torch still decodes on every core: one of its helper threads (the intra-op pool that splits the
model's matrix products) shares the scorer's core under SCHED_IDLE, so the scorer preempts it the
moment it has work and it uses the core only while the scorer waits; the other helpers stay off
that core. A helper at normal priority there starves the scorer, one thread fewer leaves most of
that core idle, and an unpinned idle helper may land beside the decoding thread, which then spins
waiting for it. The sparse layer's own step runs on
`LAYER_STEP_THREADS` (one; set around it in kvtier.sparse.attention): its products are small, and
a helper preempted by the scorer would hold up the whole op. Every other mode has no scorer and
decodes on every core at normal priority. `kvtier generate` and the benchmarks decode under
`decoding`; the sparse path's APP calibration measures its host rates on the layer step's threads
(kvtier.sparse.planner).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

import torch

_kept_free: dict[int, int] = {}  # native thread id -> the core its decode keeps free for the scorer

SCORER_MODES = frozenset({"sparse"})  # modes whose decode shares the machine with the storage scorer process
LAYER_STEP_THREADS = 1  # torch threads of a sparse layer's own decode step (kvtier.sparse.attention)


def machine_threads() -> int:
    """Cores this thread may run on, the one its decode keeps free for the scorer included."""
    return len(os.sched_getaffinity(0)) + (threading.get_native_id() in _kept_free)


def scorer_core() -> int | None:
    """The core a scorer process started from this thread runs on: the last of the thread's cores (the one its
    decode keeps free), None on a single core."""
    kept = _kept_free.get(threading.get_native_id())
    if kept is not None:
        return kept
    cores = os.sched_getaffinity(0)
    return max(cores) if len(cores) > 1 else None


def _has_scorer(mode: str) -> bool:
    return mode.split("-")[0] in SCORER_MODES


def decode_threads(mode: str) -> int:
    """Torch threads for `mode`'s decode steps: every core (a scorer mode's helpers yield, `_yielding_helpers`)."""
    return machine_threads()


@contextmanager
def decoding(mode: str | None):
    """Decode `mode` on its torch threads and cores (None: as set now), then restore them."""
    if mode is None:
        yield
        return
    core = scorer_core() if _has_scorer(mode) else None
    with torch_threads(decode_threads(mode)), _off_scorer_core(core), _yielding_helpers(core):
        yield


@contextmanager
def _off_scorer_core(core: int | None):
    """Keep the calling thread (and threads it starts) off the scorer's `core` (None: no scorer, nothing to do)."""
    if core is None:
        yield
        return
    thread, before = threading.get_native_id(), os.sched_getaffinity(0)
    outer = _kept_free.get(thread)
    os.sched_setaffinity(0, before - {core})
    _kept_free[thread] = core
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        if outer is None:
            del _kept_free[thread]


@contextmanager
def _yielding_helpers(core: int | None):
    """With a scorer on `core`, one of torch's helper threads shares it under SCHED_IDLE and the others stay off it
    (with the decoding thread); afterwards each runs where and as it did."""
    helpers = sorted(torch_helpers()) if core is not None and torch.get_num_threads() > 1 else []
    if not helpers:
        yield
        return
    before = {tid: (os.sched_getscheduler(tid), os.sched_getaffinity(tid)) for tid in helpers}
    *others, yielding = helpers
    for tid in others:
        os.sched_setaffinity(tid, os.sched_getaffinity(0))  # the decoding thread's cores: not the scorer's
    os.sched_setaffinity(yielding, {core})
    os.sched_setscheduler(yielding, os.SCHED_IDLE, os.sched_param(0))
    try:
        yield
    finally:
        for tid, (policy, cores) in before.items():
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:  # the pool shrank meanwhile
                pass


def torch_helpers() -> list[int]:
    """Native ids of torch's intra-op helper threads: the threads Python did not start that run a parallel op."""
    started_by_python = {thread.native_id for thread in threading.enumerate()}
    before = _cpu_ns()
    ones = torch.ones(1 << 18)
    for _ in range(8):  # large enough that torch splits it over every thread
        ones.mul_(1.0)
    after = _cpu_ns()
    return [tid for tid, ns in after.items() if tid not in started_by_python and ns > before.get(tid, 0)]


def _cpu_ns() -> dict[int, int]:
    """Nanoseconds on a CPU so far, per thread of this process, up to date even for a thread running now."""
    seen = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        try:  # Linux's clock id of a thread's CPU time: (~tid << 3) | per-thread (4) | scheduler's count (2)
            seen[tid] = time.clock_gettime_ns((~tid << 3) | 6)
        except OSError:  # the thread ended meanwhile
            continue
    return seen


@contextmanager
def torch_threads(count: int):
    """Run the block on `count` torch threads, then restore the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def thread_settings() -> dict:
    """What a result records about torch threads."""
    return {"prefill": machine_threads(),
            "decode": {**{mode: decode_threads(mode) for mode in sorted(SCORER_MODES)},
                       "other modes": machine_threads()},
            "helpers_yield_to_scorer": True}


def describe_threads(recorded: dict | int) -> str:
    """`thread_settings()` as text; an int is a result from before threads were set per phase (one for all)."""
    if isinstance(recorded, int):
        return f"{recorded} (prefill and decode, every mode)"
    decode = ", ".join(f"{mode} {n}" for mode, n in recorded["decode"].items())
    text = f"prefill {recorded['prefill']}; decode {decode}"
    if recorded.get("helpers_yield_to_scorer"):
        text += f"; {', '.join(sorted(SCORER_MODES))}: torch's helper threads yield to the scorer (SCHED_IDLE)"
    return text
