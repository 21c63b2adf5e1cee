"""One prompt put into a fresh cache with the document store, and what a damaged stored entry changes.

The prompt's longest stored prefix is loaded into the cache and the rest prefilled, recorded into a new entry
when the prompt publishes one (reuse.py); after `place_prompt`, what the cache placed (the sparse tiers) goes
into that entry too (or into the reused entry, when it lacks them), and the entry is published when the answer
is done. A stored entry found damaged, when the cache is built on it, while its K/V are replayed, or while the
decode reads it in place (a sparse image, offload's stored K/V), is handled as the store's `on_corrupt` says:
`fail` raises the error and keeps the entry; `recompute` removes it and the prompt goes in again cold. Found while
decoding, the entry being written is dropped too (it may hold copies of the damaged records) and the answer starts
over: the tokens already handed out are checked against the new ones, not handed out again (AnswerStream).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kvtier.docstore.document_store import Match
from kvtier.docstore.entry import CorruptEntry, EntryWriter
from kvtier.docstore.reuse import PromptReuse
from kvtier.errors import ChecksumError, DamagedEntryError, StorageError
from kvtier.kv.contract import KVCache

log = logging.getLogger(__name__)


class StoredPrefixDropped(Exception):
    """A stored prefix the cache reads in place failed a check while decoding and its entry is gone
    (`--on-corrupt recompute`): the prompt is to be answered again, cold."""


class RecomputeDiverged(StorageError):
    """The answer computed again after a damaged stored prefix differs from the tokens already handed out."""


@dataclass
class PromptIn:
    """Puts one prompt into a fresh cache: the stored prefix `reuse` found loaded (none without a store), the rest
    prefilled and recorded into the entry it publishes."""

    reuse: PromptReuse | None
    new_cache: Callable[[Match | None], KVCache]  # a fresh cache, built on the stored prefix a replay will feed it
    prefill: Callable[[KVCache, int], torch.Tensor]  # the prompt from a position on into the cache: logits [B, vocab]
    reused: int = 0  # prompt tokens loaded from the store
    writer: EntryWriter | None = None

    def into_cache(self) -> tuple[KVCache, torch.Tensor, float]:
        """(cache, the last position's logits [B, vocab], when the prefill started). A damaged stored prefix is
        raised (`fail`) or dropped and the prompt put in again cold (`recompute`)."""
        reuse = self.reuse
        try:
            cache = self.new_cache(reuse.match if reuse is not None else None)
        except DamagedEntryError as error:
            return self._again_cold(error)
        started = time.perf_counter()
        try:
            if reuse is None:
                return cache, self.prefill(cache, 0), started
            with reuse.recording(cache) as writer:
                self.reused = reuse.replay(cache)
                stored = cache.stored_in_place()
                if stored is not None:
                    reuse.bytes_read += stored.bytes_read
                logits = self.prefill(cache, self.reused)
            self.writer = writer
            return cache, logits, started
        except CorruptEntry as error:
            cache.close()
            return self._again_cold(error)
        except BaseException:
            cache.close()
            raise

    @contextmanager
    def decoding(self, cache: KVCache) -> Iterator[None]:
        """Around the decode, after `place_prompt`: what the cache placed goes into the entry being written first
        (before a decode step changes it). A stored prefix the cache reads in place that fails a check drops that
        entry and is raised (`fail`) or dropped, raising StoredPrefixDropped (`recompute`)."""
        try:
            store_placed(cache, self.reuse, self.writer)
            yield
        except (ChecksumError, CorruptEntry) as error:
            stored = cache.stored_in_place()
            if stored is None or not stored.holds(error):
                raise  # about the run's own files
            if self.writer is not None:
                self.reuse.store.discard(self.writer)
                self.writer = None
            self.reuse.forget_damaged(error)
            raise StoredPrefixDropped(str(error)) from error

    def publish(self) -> None:
        """Once the answer is done (or failed): publish the entry written, unless a write failed or it is empty."""
        if self.reuse is not None:
            self.reuse.publish(self.writer)

    def _again_cold(self, error: DamagedEntryError) -> tuple[KVCache, torch.Tensor, float]:
        self.reuse.forget_damaged(error)
        return self.into_cache()


def store_placed(cache: KVCache, reuse: PromptReuse | None, writer: EntryWriter | None) -> None:
    """After `place_prompt`: add what `cache` placed (the sparse tiers) to the entry `writer` writes, or, when the
    prompt writes none, to the stored entry it reuses, if that entry lacks them for the cache's settings (a document
    first stored by another KV mode gains them). A failed write leaves the entry without them."""
    if writer is not None:
        if writer.failure is not None:
            return
        entry_dir, tokens = writer.directory, writer.blocks_written * writer.meta.block_tokens
    elif reuse is not None and reuse.match is not None:
        entry_dir, tokens = reuse.match.entry.path, reuse.match.tokens
    else:
        return
    try:
        cache.save_placed(entry_dir, tokens)
    except OSError as error:
        log.warning("cannot store the sparse tiers with the document (%s); it is stored without them",
                    error.strerror or error)


@dataclass
class AnswerStream:
    """The new tokens handed to `on_text` / `on_token`, across the attempts of one answer: an attempt after the
    first re-derives the tokens already handed out, which are checked instead of handed out again."""

    tokenizer: object
    on_text: Callable[[str], None] | None
    on_token: Callable[[int], None] | None
    ids: list[int] = field(default_factory=list)  # handed out
    shown: str = ""  # the text of `ids` handed to on_text
    first_at: float = 0.0  # when the first token was handed out
    position: int = 0  # of the current attempt's next token

    def restart(self) -> None:
        self.position = 0

    def put(self, token: int) -> None:
        """The current attempt's next token: handed out, or checked against the one handed out at its place."""
        position, self.position = self.position, self.position + 1
        if position < len(self.ids):
            if token != self.ids[position]:
                raise RecomputeDiverged(f"the answer computed again without the damaged KV store entry differs "
                                        f"from the one already streamed at new token {position + 1}; it stops there")
            return
        self.ids.append(token)
        self.first_at = self.first_at or time.perf_counter()
        if self.on_text is not None:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if text.startswith(self.shown) and len(text) > len(self.shown):
                self.on_text(text[len(self.shown) :])
                self.shown = text
        if self.on_token is not None:
            self.on_token(token)
