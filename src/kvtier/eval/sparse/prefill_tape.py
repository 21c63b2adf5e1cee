"""One dense prefill, recorded once and replayed into the cache of every mode a benchmark compares.

Every KV mode prefills densely (exact attention over the whole prompt), so the K/V that a
mode's cache receives through `update` while the prompt goes in are the same whatever the
mode. A benchmark that compares decode steps at long contexts can therefore run the model
over the prompt once, record those `update` calls, and replay them into each mode's cache
instead of running the model again per mode. The prompt's last chunk is not recorded: it
goes through the model for real in every mode, so what a mode does during prefill
attention (the sparse path keeps the last prompt queries to place tokens hot or cold) sees
real queries, and the logits that start decoding come from that mode's forward pass.

Why: a long prompt's prefill dominates a long-context run, once per mode compared
(a 32K prompt took ~6 minutes per sequence, so ~50 minutes per mode at batch 8). Recorded per sequence (batch 1 at a
time, so the chunk's attention never holds 8 sequences' scores), then stacked into batch rows.
Memory: the tape holds the prompt's full K/V (what the dense mode holds anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvtier.generation import prefill
from kvtier.kv.model_geometry import text_config

Update = tuple[int, torch.Tensor, torch.Tensor]  # (layer index, K, V [batch, heads, n, head_dim])
RowCalls = Callable[[torch.Tensor, int], list[Update]]  # a row's calls for its first n tokens: (ids [1, N], n)


@dataclass
class PrefillTape:
    """The `update` calls of a dense chunked prefill of ids[:, :recorded], and the ids themselves."""

    ids: torch.Tensor  # [batch, prompt tokens]
    chunk: int
    recorded: int  # prompt tokens covered by `updates` (every chunk but the last)
    updates: list[Update]

    @property
    def passes(self) -> int:
        """Forward passes (or replayed chunks) a prefill from this tape reports: as many as a real prefill."""
        return -(-self.ids.shape[1] // self.chunk)

    def rows(self, rows: slice) -> PrefillTape:
        """The tape of some batch rows only (views, no copy)."""
        return PrefillTape(self.ids[rows], self.chunk, self.recorded,
                           [(layer, keys[rows], values[rows]) for layer, keys, values in self.updates])

    def prefill(self, model, cache, on_chunk: Callable[[], None] = lambda: None) -> torch.Tensor:
        """Replay the recorded updates into `cache`, run the last chunk through `model`; last logits [B, vocab]."""
        layers = len({layer for layer, _, _ in self.updates})
        for index, (layer, keys, values) in enumerate(self.updates):
            cache.update(keys, values, layer)
            if (index + 1) % layers == 0:  # one recorded chunk fed to every layer
                on_chunk()
        return prefill(model, cache, self.ids[:, self.recorded :], self.chunk, lambda tokens: on_chunk())


def recorded_tokens(prompt_tokens: int, chunk: int) -> int:
    """Prompt tokens a tape records: every whole chunk but the last (at least one token runs live)."""
    return (prompt_tokens - 1) // chunk * chunk


def record(model, ids: torch.Tensor, chunk: int, on_chunk: Callable[[], None] = lambda: None,
           row_calls: RowCalls | None = None) -> PrefillTape:
    """Prefill each row of `ids` [B, N] densely, `chunk` tokens per pass, recording all but the last chunk.
    `row_calls`: where a row's calls come from instead (the document store: stored_rows.py)."""
    recorded = recorded_tokens(ids.shape[1], chunk)

    def prefilled(row_ids: torch.Tensor, tokens: int) -> list[Update]:
        return record_row(model, row_ids[:, :tokens], chunk, on_chunk)

    updates: list[Update] = []
    for row in range(ids.shape[0]):
        calls = (row_calls or prefilled)(ids[row : row + 1], recorded)
        if not updates:
            updates = [(layer, keys.new_empty((ids.shape[0], *keys.shape[1:])),
                        values.new_empty((ids.shape[0], *values.shape[1:]))) for layer, keys, values in calls]
        for (_, keys, values), (_, row_keys, row_values) in zip(updates, calls):
            keys[row], values[row] = row_keys[0], row_values[0]
        del calls  # freed before the next row allocates its own
    return PrefillTape(ids, chunk, recorded, updates)


class _RecordingCache(DynamicCache):
    """A dense cache that keeps a copy of every update it receives.

    A subclass rather than a wrapper around a DynamicCache's bound `update`: that wrapper made a
    reference cycle, so each row's cache outlived the row until the cyclic collector ran, and at
    batch 8 x 32K the process nearly ran out of memory.
    """

    def __init__(self, config) -> None:
        super().__init__(config=config)
        self.calls: list[Update] = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.calls.append((layer_idx, key_states.clone(), value_states.clone()))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def record_row(model, ids: torch.Tensor, chunk: int, on_chunk: Callable[[], None],
               also: Callable[[DynamicCache], AbstractContextManager] = nullcontext) -> list[Update]:
    """The update calls a dense cache receives while `ids` [1, n] is prefilled; `also(cache)` is entered around
    the prefill (the store writes the updates to an entry as they come: stored_rows.py)."""
    cache = _RecordingCache(text_config(model))
    if ids.shape[1]:
        with torch.inference_mode(), also(cache):
            prefill(model, cache, ids, chunk, lambda tokens: on_chunk())
    return cache.calls
