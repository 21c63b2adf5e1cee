"""A benchmark prompt's rows through the document KV store: a rerun reads its recorded prefill back.

`kvtier bench sparse` prefills its prompt once and replays the recorded K/V into
every mode's cache (prefill_tape.py). That prefill is most of a long-context
run, and its K/V are what the document store keeps for `kvtier generate`: every
mode prefills densely. So each row is looked up in the store as a prompt would
be. When an entry holds the row's whole recorded part, its K/V are read back
(O_DIRECT, every record's crc32c checked) and cut into the chunks a prefill
would have fed. Otherwise the row is prefilled, its K/V written to a new entry
as they come, and the entry published once complete (write, fsync, rename). A
damaged entry is dropped and the row prefilled again (`--on-corrupt recompute`)
or the error raised (`fail`). A row is looked up with one token past its
recorded part, as the store always leaves a prompt's last token to the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from kvtier.eval.sparse.prefill_tape import Update, record_row
from kvtier.docstore import DocumentStore
from kvtier.docstore.meta import CorruptEntry
from kvtier.docstore.reuse import PromptReuse


class StoredRows:
    """`prefill_tape.record`'s row calls: from `store` where it holds them, else prefilled and stored."""

    def __init__(self, llm, store: DocumentStore, chunk: int, on_chunk: Callable[[], None]) -> None:
        self.llm, self.store, self.chunk, self.on_chunk = llm, store, chunk, on_chunk
        self.rows_read = 0  # rows whose K/V came from the store
        self.bytes_read = 0

    def __call__(self, row_ids: torch.Tensor, tokens: int) -> list[Update]:
        """The update calls of a dense prefill of row_ids[:, :tokens] (row_ids [1, N], N > tokens)."""
        reuse = PromptReuse.plan(self.store, self.llm, row_ids[:, : tokens + 1], self._head(row_ids))
        if reuse.match is not None and reuse.match.tokens == tokens:
            try:
                return self._read(reuse, tokens)
            except CorruptEntry as error:
                reuse.forget_damaged(error)
        return record_row(self.llm.model, row_ids[:, :tokens], self.chunk, self.on_chunk,
                          lambda cache: _published(reuse, cache))

    def _read(self, reuse: PromptReuse, tokens: int) -> list[Update]:
        layers = _Layers()
        reuse.replay(layers)
        self.rows_read += 1
        self.bytes_read += reuse.bytes_read
        for _ in range(tokens // self.chunk):
            self.on_chunk()
        return [(layer, keys[:, :, start : start + self.chunk], values[:, :, start : start + self.chunk])
                for start in range(0, tokens, self.chunk) for layer, (keys, values) in sorted(layers.kv.items())]

    def _head(self, row_ids: torch.Tensor) -> str:
        """The row's first words, what `kvtier store list` shows of its entry."""
        return self.llm.tokenizer.decode(row_ids[0, :32].tolist())


class _Layers:
    """Takes a stored prefix's replay, one update per layer."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> None:
        self.kv[layer] = (keys, values)


@contextmanager
def _published(reuse: PromptReuse, cache) -> Iterator[None]:
    """While a row is prefilled into `cache`: its updates go to a new entry, published when the row is in."""
    with reuse.recording(cache) as writer:
        yield
    reuse.publish(writer)
