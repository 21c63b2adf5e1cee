"""The serving engine's tiered sequences on the sparse path: each one a sparse cache (HillInfer's tiers) of its own.

`SparseTiers` is the engine's `TierProvider` (kvtier.engine.tiered): a request too long for the paged
pool gets a batch-1 sparse cache sized by the engine's per-sequence budgets, on the engine's one model
instance. With a document KV store, its prompt's longest stored prefix is loaded into the cache (a
stored sparse image used in place, read-only: each request writes only its own files), and a new
document is stored by the first request that prefills it; a second request for the same document
while that prefill runs prefills alongside and stores nothing.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager, ExitStack

import torch

from kvtier.docstore.document_store import DocumentStore
from kvtier.docstore.entry import CorruptEntry, EntryWriter
from kvtier.docstore.recovery import store_placed
from kvtier.docstore.reuse import PromptReuse
from kvtier.engine.paged_attention import causal_mask
from kvtier.errors import ConfigError, DamagedEntryError, StorageError
from kvtier.kv.contract import tier_bytes
from kvtier.kv.model_geometry import model_geometry
from kvtier.modes import KVConfig, make_cache
from kvtier.sparse import attention
from kvtier.sparse.stats import MASS_BUCKETS, BudgetTotals
from kvtier.sparse.threads import machine_threads, torch_threads
from kvtier.units import format_size

COUNTERS = ("requests", "cold_read_bytes", "scorer_restarts", "reused_prompt_tokens", "kv_store_read_bytes",
            "set_asides", "set_aside_bytes", "guard_events",
            *(f"mass_kept_{name}" for name in [*(f"le_{bound}" for bound in MASS_BUCKETS), "count", "sum"]))
HEAD_TOKENS = 128  # the prompt's first tokens, decoded, name a stored document in `kvtier store list`


class SparseTiers:
    """Makes tiered sequences' KV: sparse caches with `kv_config`'s settings, reusing and filling `store`."""

    def __init__(self, llm, kv_config: KVConfig, store: DocumentStore | None = None) -> None:
        """Build before the engine: the engine replaces the model's attention, whose original this wraps."""
        self.llm, self.store = llm, store
        self.kv_config = dataclasses.replace(kv_config, kv="sparse").validated()
        self.settings = self.kv_config.sparse_settings()
        inner = llm.model.config._attn_implementation or "sdpa"
        self._attention = attention.function(inner if inner in ("sdpa", "eager") else "sdpa")
        self._storing: set[str] = set()  # documents a running sequence is storing
        self._open: set[SparseSequence] = set()
        self._closed = dict.fromkeys(COUNTERS, 0)  # totals of the sequences closed so far

    def window_tokens(self) -> int:
        return self.settings.sink + self.settings.recent + self.settings.retire_batch

    def check(self, host_budget: int) -> None:
        per_token = model_geometry(self.llm.model).token_bytes
        if host_budget < (self.settings.demote_batch + 1) * per_token:
            raise ConfigError(f"a tiered sequence's share of the host KV budget, {format_size(host_budget)}, cannot "
                              f"hold a hot pool ({format_size((self.settings.demote_batch + 1) * per_token)} at "
                              "least); raise the host KV budget or lower the tiered sequences run at once")

    def open(self, prompt_ids: list[int], max_tokens: int, device_budget: int, host_budget: int
             ) -> tuple[SparseSequence, int]:
        kv_config = dataclasses.replace(self.kv_config, device_kv_budget=device_budget, host_kv_budget=host_budget)
        reuse = self._plan(prompt_ids)
        while True:
            try:
                cache = make_cache(self.llm.model, kv_config, max_tokens, 1, self.llm.model_id,
                                   reuse.match if reuse is not None else None, route_attention=False)
            except DamagedEntryError as error:  # a stored entry's K/V or its sparse tiers
                reuse.forget_damaged(error)  # `fail`: raises; `recompute`: prefill it all, as if nothing were stored
                continue
            sequence = SparseSequence(self, cache)
            self._open.add(sequence)
            try:
                return sequence, sequence.load(reuse)
            except CorruptEntry as error:
                sequence.close()
                reuse.forget_damaged(error)
            except BaseException:
                sequence.close()
                raise

    def forwarding(self, decoding: int) -> AbstractContextManager:
        """Torch threads: the machine's cores less one per decoding sequence, at least one. Each decoding sequence's
        storage scorer, a process of its own, scores and reads during the forward; torch's helper threads beside
        it would spin on the same cores and slow both."""
        return torch_threads(max(1, machine_threads() - decoding))

    def counters(self) -> dict[str, int]:
        totals = dict(self._closed)
        for sequence in self._open:
            for name, value in sequence.counters().items():
                totals[name] += value
        return totals

    def _plan(self, prompt_ids: list[int]) -> PromptReuse | None:
        if self.store is None:
            return None
        head = self.llm.tokenizer.decode(prompt_ids[:HEAD_TOKENS], skip_special_tokens=True)
        return PromptReuse.plan(self.store, self.llm, torch.tensor([prompt_ids]), head)


class SparseSequence:
    """One tiered sequence's sparse cache, driven by the serving engine (kvtier.engine.tiered.SequenceKV)."""

    def __init__(self, tiers: SparseTiers, cache) -> None:
        self._tiers, self.cache = tiers, cache
        self._reuse: PromptReuse | None = None
        self._recording = ExitStack()  # while the prompt goes in: its K/V also written to a new store entry
        self._writer: EntryWriter | None = None
        self._document: str | None = None  # the document this sequence stores
        self._reused = 0
        self._set_asides = 0
        self._set_aside_bytes = 0
        self._failure: StorageError | None = None
        self._closed = False

    def load(self, reuse: PromptReuse | None) -> int:
        """Load the stored prefix `reuse` found and start recording the prompt when it publishes a new document
        (unless another running sequence stores the same one); the prompt tokens loaded."""
        self._reuse = reuse
        if reuse is None:
            return 0
        storing = self._tiers._storing
        if reuse.publishes and reuse.meta.document not in storing:
            self._writer = self._recording.enter_context(reuse.recording(self.cache))
            if self._writer is not None:
                self._document = reuse.meta.document
                storing.add(self._document)
        self._reused = reuse.replay(self.cache)
        return self._reused

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
               sliding_window: int | None) -> torch.Tensor:
        if self._failure is None:
            try:
                return self._attend(module, query, key, value, scaling, sliding_window)
            except StorageError as error:  # a page of its cold pool or stored image failed its checksum, a read failed
                self._failure = error
        return torch.zeros_like(query)  # the forward goes on for the others; this sequence's rows are dropped

    def _attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                sliding_window: int | None) -> torch.Tensor:
        keys, values = self.cache.update(key, value, module.layer_idx)
        mask = causal_mask(query.shape[2], keys.shape[2], sliding_window, query.device)  # keys: the layer's last ones
        mask = None if mask is None else mask[None, None]  # [1, 1, q, k], as transformers' attention takes it
        output, _ = self._tiers._attention(module, query, keys, values, mask, scaling=scaling,
                                           sliding_window=sliding_window, dropout=0.0)
        return output.transpose(1, 2)

    def failure(self) -> StorageError | None:
        return self._failure

    def forget_damaged(self) -> None:
        """After `failure`: drop the stored document this sequence read, as the store's `on_corrupt` says (`fail`
        raises the error), so its recompute prefills the prompt rather than read the damaged entry again."""
        if self._reuse is not None and self._reuse.match is not None:
            self._reuse.forget_damaged(self._failure)

    def locate(self, row: int) -> None:
        self.cache.locate(row)

    def prompt_done(self) -> None:
        self.cache.place_prompt()
        store_placed(self.cache, self._reuse, self._writer)
        if self._writer is None:
            return
        self._recording.close()  # the cache's updates are no longer recorded
        self._reuse.publish(self._writer)
        self._stop_storing()

    def set_aside(self) -> int:
        written = self.cache.set_aside()
        self._set_asides += 1
        self._set_aside_bytes += written
        return written

    def bring_back(self) -> None:
        self.cache.bring_back()

    def tier_bytes(self) -> dict[str, int]:
        return tier_bytes(self.cache, self._tiers.llm.model)

    def budget_totals(self) -> BudgetTotals:
        """The attention budget's sums over this sequence's sparse decode steps so far (mass kept, tokens attended,
        guard events); still there after `close`."""
        return self.cache.stats.budget_totals()

    def counters(self) -> dict[str, int]:
        """This sequence's part of `SparseTiers.counters`."""
        reuse = self._reuse
        return {"requests": 1, "cold_read_bytes": self.cache.io_stats().bytes_read, "scorer_restarts": self.cache.scorer_restarts(),
                "reused_prompt_tokens": self._reused,
                "kv_store_read_bytes": 0 if reuse is None else reuse.bytes_read,
                "set_asides": self._set_asides, "set_aside_bytes": self._set_aside_bytes,
                "guard_events": self.cache.attention_budget()["guard_events"],
                **{f"mass_kept_{name}": value for name, value in self.cache.stats.mass_histogram().items()}}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:  # ended before its prompt was in: nothing to publish
            self._recording.__exit__(_Unfinished, _Unfinished(), None)
            self._stop_storing()
        tiers = self._tiers
        for name, value in self.counters().items():
            tiers._closed[name] += value
        tiers._open.discard(self)
        self.cache.close()

    def _stop_storing(self) -> None:
        self._writer = None
        self._tiers._storing.discard(self._document)


class _Unfinished(Exception):
    """Ends a prompt's recording before the prompt was in: the entry being written is discarded."""
