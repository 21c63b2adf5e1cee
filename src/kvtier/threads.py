"""Torch threads per phase: prefill on every core; decode leaves one core to the scorer process where one runs.

The sparse path's storage scorer is a process of its own that works during decode and needs a
core: on the 2-core development VM `--kv sparse` decodes on one torch thread (torch's spinning
pool starves the scorer otherwise). Every other mode has no such process and decodes on every core:
holding a baseline to fewer threads because our system needs a core would flatter us
(docs/decisions.md has the measurement). Prefill is dense in every mode and runs before the scorer has work: every core.
`kvtier generate` and the benchmarks decode under `decode_threads`; the sparse path's APP
calibration is kept per thread count (kvtier.sparse.planner), as its host rates scale with it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

SCORER_MODES = frozenset({"sparse"})  # modes whose decode shares the machine with the storage scorer process


def machine_threads() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0))


def decode_threads(mode: str) -> int:
    """Torch threads for `mode`'s decode steps (modes may carry a suffix: `sparse-hit`)."""
    if mode.split("-")[0] in SCORER_MODES:
        return max(1, machine_threads() - 1)  # one core for the scorer process
    return machine_threads()


@contextmanager
def decoding(mode: str | None):
    """Decode `mode` on its torch threads (None: as set now), then restore the previous count."""
    if mode is None:
        yield
        return
    with torch_threads(decode_threads(mode)):
        yield


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
