"""Torch threads per phase: prefill on every core; decode leaves one core to the scorer process where one runs.

The sparse path's storage scorer is a process of its own that works during decode and needs a
core: on the 2-core development VM `--kv sparse` decodes on one torch thread (torch's spinning
pool starves the scorer otherwise). Every other mode has no such process and decodes on every core:
holding a baseline to fewer threads because our system needs a core would flatter us
(docs/decisions.md has the measurement). Prefill is dense in every mode and runs before the scorer has work: every core.
`kvtier generate` and the benchmarks decode under `decode_threads`; the sparse path's APP
calibration is kept per thread count (kvtier.sparse.planner), as its host rates scale with it.

That core is the scorer's alone (`scorer_core`): the scorer process pins itself to it, and a
scorer mode's decode keeps the decoding thread off it. Unpinned, a pipe write tends to run the
woken reader on the writer's core (a synchronous wake-up), where scorer and decoding thread take
turns while the other core idles (docs/decisions.md has the measurement).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

import torch

_kept_free: dict[int, int] = {}  # native thread id -> the core its decode keeps free for the scorer

SCORER_MODES = frozenset({"sparse"})  # modes whose decode shares the machine with the storage scorer process


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
    """Torch threads for `mode`'s decode steps (modes may carry a suffix: `sparse-hit`)."""
    if _has_scorer(mode):
        return max(1, machine_threads() - 1)  # one core for the scorer process
    return machine_threads()


@contextmanager
def decoding(mode: str | None):
    """Decode `mode` on its torch threads and cores (None: as set now), then restore them."""
    if mode is None:
        yield
        return
    with torch_threads(decode_threads(mode)), _off_scorer_core(mode):
        yield


@contextmanager
def _off_scorer_core(mode: str):
    """For a scorer mode, keep the calling thread (and threads it starts) off `scorer_core()`."""
    core = scorer_core() if _has_scorer(mode) else None
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
                       "other modes": machine_threads()}}


def describe_threads(recorded: dict | int) -> str:
    """`thread_settings()` as text; an int is a result from before threads were set per phase (one for all)."""
    if isinstance(recorded, int):
        return f"{recorded} (prefill and decode, every mode)"
    return f"prefill {recorded['prefill']}; decode " + ", ".join(f"{mode} {n}" for mode, n in recorded["decode"].items())
