"""One prompt's use of the document store: the stored prefix it loads, and the entry it publishes.

Before prefill, the prompt's whole blocks are keyed (keys.py) and the longest
stored prefix is found; at least one prompt token is always left to run through
the model, whose logits start decoding. The prefix's K/V are read back layer by
layer and fed to the cache through `update`, as a prefill would feed them.

A prompt publishes an entry when most of its whole blocks were not reused (a new
document, or one mostly different): while the prompt goes in, every K/V update
the cache receives is also written to the entry (`recording`), and the entry is
published after decode. A question asked of a stored document reuses it and
stores nothing: its own few blocks are not worth a second copy of the document.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass

import torch

from kvtier.errors import StorageError
from kvtier.kv.model_geometry import model_geometry
from kvtier.storage import IOEngine
from kvtier.docstore.entry import EntryMeta, EntryWriter, read_layers
from kvtier.docstore.keys import block_keys, document_key, identity_of
from kvtier.docstore.document_store import DocumentStore, Match, worth_an_entry

log = logging.getLogger(__name__)
HEAD_CHARS = 60
READ_THREADS = 4


@dataclass
class PromptReuse:
    store: DocumentStore
    meta: EntryMeta  # the entry this prompt would publish (blocks filled in when it is)
    keys: list[str]
    match: Match | None
    device: torch.device  # the model's: where the cache wants its K/V
    bytes_read: int = 0  # from the store, by `replay`

    @classmethod
    def plan(cls, store: DocumentStore, llm, ids: torch.Tensor, text: str) -> PromptReuse:
        """Look up the prompt `ids` [1, n] (the tokens of `text`) in `store`."""
        identity = identity_of(llm)
        digest, tokens = identity.digest(), ids[0].tolist()
        keys = block_keys(digest, tokens, identity.block_tokens)
        geometry = model_geometry(llm.model)
        meta = EntryMeta(vars(identity), digest, document_key(tokens), identity.block_tokens, keys,
                         [[geometry.num_kv_heads, geometry.head_dim]] * geometry.num_layers, identity.dtype, [],
                         " ".join(text[: 4 * HEAD_CHARS].split())[:HEAD_CHARS], 0.0)
        usable = (len(tokens) - 1) // identity.block_tokens  # leave a token for the model's logits
        match = store.longest_prefix(meta.identity_digest, keys, meta.document, usable)
        return cls(store, meta, keys, match, llm.model.device)

    @property
    def publishes(self) -> bool:
        return worth_an_entry(len(self.keys), self.match.blocks if self.match else 0)

    def replay(self, cache) -> int:
        """Feed the stored prefix's K/V to `cache`; the tokens fed. Raises CorruptEntry when a check fails (the
        caller then drops the entry and prefills in a fresh cache, or stops: `--on-corrupt`)."""
        if self.match is None:
            return 0
        entry = self.match.entry
        with IOEngine(READ_THREADS) as io, closing(read_layers(entry.path, entry.meta, self.match.blocks, io)) as layers:
            for layer, keys, values in layers:  # the next layer is read meanwhile
                cache.update(keys.to(self.device), values.to(self.device), layer)
        self.store.touch(entry)
        self.bytes_read = self.match.blocks * entry.meta.block_span
        return self.match.tokens

    def forget_damaged(self, error: StorageError) -> None:
        """After a damaged entry (`error` says why), as the store's `on_corrupt` says: `fail` raises `error` and keeps
        the entry; `recompute` removes it, so the whole prompt is prefilled (and published) as if nothing were
        stored."""
        if self.store.on_corrupt == "fail":
            raise error
        self.store.drop(self.match.entry.path, str(error))
        self.match = None

    @contextmanager
    def recording(self, cache) -> Iterator[EntryWriter | None]:
        """While the prompt goes into `cache`: every K/V update also goes to a new entry (when this prompt publishes)."""
        writer = self._writer() if self.publishes else None
        if writer is None:
            yield None
            return
        update = cache.update

        def update_and_record(key_states, value_states, layer_idx, *args, **kwargs):
            writer.add(layer_idx, key_states, value_states)
            return update(key_states, value_states, layer_idx, *args, **kwargs)

        cache.update = update_and_record
        try:
            yield writer
        except BaseException:  # the prompt did not go in: nothing to publish
            self.store.discard(writer)
            raise
        finally:
            del cache.update  # the instance attribute only: no reference cycle outlives the prefill

    def _writer(self) -> EntryWriter | None:
        directory = self.store.room_for(self.meta.nbytes)
        if directory is None:
            return None
        try:
            return EntryWriter(directory, self.meta)
        except OSError as error:
            self.store.cannot_write(error, directory)
        except StorageError as error:  # a layout the store cannot hold
            log.warning("%s; the prompt is not stored", error)
        return None

    def publish(self, writer: EntryWriter | None) -> str | None:
        if writer is None:
            return None
        if writer.failure is not None or writer.blocks_written == 0:
            self.store.discard(writer, writer.failure)
            return None
        return self.store.publish(writer)
