"""Tiered sequences: requests whose KV outgrows the paged pool, decoded in the same batched forward as the rest.

A tiered sequence keeps its KV in a cache of its own (HillInfer's tiers: sink and recent window on the
device, hot pool in host DRAM, cold pool on flash scored by the storage scorer), made by a
`TierProvider` that the layer above the engine supplies (the engine imports no KV mode). In a forward,
the paged attention hands a tiered sequence's tokens to its `SequenceKV.attend`, which stores them and
attends: dense over the prompt while it prefills, sparse selection and exact attention once it decodes.

Budgets are the engine's. The device budget is the paged pool: a tiered sequence reserves pool blocks
for its device window (sink + recent + the tokens waiting to retire, every layer), which it keeps in
tensors of its own, so paged and tiered KV together never exceed it. The host budget is split into
`max_tiered_seqs` equal shares, one per running tiered sequence's hot pool. A running tiered sequence
can be preempted (scheduler.py): its KV is set aside, only what is not on flash already written there.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtier.errors import StorageError


class SequenceKV(Protocol):
    """One tiered sequence's KV (batch 1), as the engine drives it."""

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None, sliding_window: int | None) -> torch.Tensor:
        """Store the step's new K/V [1, Hkv, q, D] of layer `module.layer_idx` and attend the queries [1, Hq, q, D]
        (the sequence's next q tokens) over the sequence's KV; returns [1, Hq, q, D]."""

    def failure(self) -> StorageError | None:
        """The error of a read that failed in the last forward (a checksum, an I/O error), else None. The sequence's
        rows of that forward are meaningless; the engine recomputes it (after `forget_damaged`) or ends it."""

    def forget_damaged(self) -> None:
        """After `failure`: drop the stored data the KV was read from, so a recompute does not read it again. Raises
        the failure when the store is set to fail on damaged entries."""

    def locate(self, row: int) -> None:
        """The sequence's last token sits at `row` of the next forward's packed tokens."""

    def prompt_done(self) -> None:
        """Every prompt token is in: tier the prompt's KV (and store the document) before the first decode."""

    def set_aside(self) -> int:
        """Preempted: write what is not on flash yet (device window, hot pool) to flash and let go of it; returns
        the bytes written. Only after `prompt_done`. Raises StorageError with the KV as it was."""

    def bring_back(self) -> None:
        """Resume after `set_aside`, exactly where it stopped. Raises StorageError (ChecksumError) when the
        set-aside KV cannot be read back whole; the sequence must then be recomputed (close this KV)."""

    def tier_bytes(self) -> dict[str, int]:
        """KV bytes held now per tier ("device", "host", "storage"; set-aside bytes count as storage)."""

    def close(self) -> None:
        """Release every tier (device window, host pool, files). Safe to call more than once."""


class TierProvider(Protocol):
    """Makes a tiered sequence's KV."""

    def window_tokens(self) -> int:
        """Tokens per layer a tiered sequence keeps on the device."""

    def check(self, host_budget: int) -> None:
        """Raise ConfigError when a sequence's share of the host budget cannot hold a hot pool."""

    def open(self, prompt_ids: list[int], max_tokens: int, device_budget: int, host_budget: int
             ) -> tuple[SequenceKV, int]:
        """A fresh KV for a sequence of up to `max_tokens` tokens whose prompt is `prompt_ids`, and how many leading
        prompt tokens are already in it (a stored document's prefix)."""

    def forwarding(self, decoding: int) -> AbstractContextManager:
        """The context of a forward in which `decoding` tiered sequences decode (> 0): e.g. fewer torch threads, so
        that what works for them beside the forward (their scorer processes) keeps cores of its own."""

    def counters(self) -> dict[str, int]:
        """Totals over every tiered sequence so far, by name (e.g. bytes read from cold pools), for /metrics."""


@dataclass(frozen=True)
class TierBudgets:
    """What each tiered sequence may hold: its device window's bytes (reserved as pool blocks) and host share."""

    device_blocks: int  # pool blocks reserved per tiered sequence
    device_bytes: int
    host_bytes: int


@dataclass(frozen=True)
class Tiers:
    """The engine's tiered sequences: who makes their KV, what each may hold, how many run at once, and how many
    tokens one decodes before it yields its share to a waiting one (0: it runs to its end)."""

    provider: TierProvider
    budgets: TierBudgets
    max_seqs: int
    slice_tokens: int = 0
