"""Greedy generation with a chosen KV mode: chunked prefill with progress, streamed decode, measured summary."""

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from kvtier.errors import ChecksumError, StorageError
from kvtier.kv.contract import tier_bytes
from kvtier.kv.offload import OffloadCache
from kvtier.models.prompts import check_context, prompt_ids
from kvtier.modes import KVConfig, make_cache
from kvtier.sparse.cache import SparseCache
from kvtier.sparse.cold.cold_image import IMAGE_DIR, CorruptImage
from kvtier.docstore.entry import CorruptEntry, EntryWriter
from kvtier.docstore.reuse import PromptReuse
from kvtier.docstore.document_store import DocumentStore
from kvtier.sparse.threads import decoding

log = logging.getLogger(__name__)
# Called with the cache after each prefill chunk and each new token; True cancels the generation.
Watch = Callable[[object], bool]


class GenerationCancelled(Exception):
    """`watch` cancelled the generation during its prefill: no token was generated, nothing was stored."""


@dataclass
class GenerationResult:
    """What one generation produced and what it cost. Every KV mode reports the same fields."""

    text: str
    token_ids: list[int]
    kv_mode: str
    prefill_tokens: int
    decode_tokens: int
    prefill_s: float
    decode_s: float
    ms_per_token: float  # decode_s over the decode forward passes (the first new token comes from prefill)
    disk_bytes_read: int
    disk_bytes_written: int
    kv_bytes: dict[str, int] = field(default_factory=dict)  # device / host / storage at the end
    reused_prompt_tokens: int = 0  # loaded from the document KV store instead of prefilled
    kv_store_bytes_read: int = 0
    ttft_s: float = 0.0  # from the request (model loaded) to the first new token, store lookup included
    scorer_restarts: int = 0  # sparse mode: times the storage scorer process was restarted

    def to_json(self) -> dict:
        return asdict(self)


def _eos_ids(llm) -> set[int]:
    eos = llm.model.generation_config.eos_token_id
    if eos is None:
        eos = llm.tokenizer.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


def prefill(model, cache, ids: torch.Tensor, chunk: int, on_chunk: Callable[[int], object] = lambda tokens: None
            ) -> torch.Tensor:
    """Feed the prompt `ids` [B, N] `chunk` tokens per forward pass (bounds the attention's memory), calling
    `on_chunk(tokens)` after each; the last position's logits [B, vocab]."""
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start : start + chunk]
        logits = model(input_ids=piece, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        on_chunk(piece.shape[1])
    return logits


def _prefill_with_progress(model, ids: torch.Tensor, cache, chunk: int, progress: bool,
                           watch: Watch | None) -> torch.Tensor:
    with tqdm(total=ids.shape[1], desc="prefill", unit="tok", disable=not progress, file=sys.stderr,
              leave=False) as bar:

        def on_chunk(tokens: int) -> None:
            bar.update(tokens)
            if watch is not None and watch(cache):
                raise GenerationCancelled("cancelled during the prefill")

        return prefill(model, cache, ids, chunk, on_chunk)


def generate(
    llm,
    prompt: str,
    max_new_tokens: int = 64,
    kv_config: KVConfig | None = None,
    prefill_chunk: int = 1024,
    on_text: Callable[[str], None] | None = None,
    progress: bool = True,
    input_ids: torch.Tensor | None = None,
    kv_store: DocumentStore | None = None,
    on_token: Callable[[int], None] | None = None,
    choose: Callable[[torch.Tensor], int] | None = None,
    watch: Watch | None = None,
    eos_token_ids: set[int] | None = None,
) -> GenerationResult:
    """Decode up to `max_new_tokens` tokens after `prompt` (or after explicit `input_ids`), greedily by default.

    `on_text` receives each new piece of decoded text as it is produced; `on_token` receives each
    new token id. `choose` picks the next token from the last position's logits [1, vocab] (default:
    argmax). `watch` sees the cache after every prefill chunk and every new token (before `on_token`
    gets it), to read its tiers; returning True cancels: during the prefill by raising
    GenerationCancelled (nothing is stored), during the decode by ending after that token (a
    server's client went away). Generation stops at an id of `eos_token_ids` (default: the model's;
    an empty set never stops early, vLLM's `ignore_eos`). With a `kv_store`, the prompt's longest
    stored prefix is loaded instead of computed, and a new document is stored (kvtier.docstore.reuse).
    A stored prefix found damaged while decoding (a sparse image or the K/V that offload reads in place;
    `--on-corrupt recompute`) makes the answer start over cold; the tokens already handed out are checked,
    not handed out again (RecomputeDiverged).
    """
    kv_config = (kv_config or KVConfig()).validated()
    ids = prompt_ids(llm, prompt) if input_ids is None else input_ids
    check_context(llm, ids.shape[1], max_new_tokens)
    requested = time.perf_counter()
    reuse = PromptReuse.plan(kv_store, llm, ids, prompt) if kv_store is not None else None
    run = _Run(llm, kv_config, ids, max_new_tokens, prefill_chunk, progress, watch, choose,
               _eos_ids(llm) if eos_token_ids is None else eos_token_ids, _Stream(llm.tokenizer, on_text, on_token))
    with torch.inference_mode():
        result = run.once(reuse)
        if result is None:  # a stored prefix failed a check after the prompt went in: its entry is gone, answer cold
            result = run.once(reuse)
    result.ttft_s = run.stream.first_at - requested
    return result


class RecomputeDiverged(StorageError):
    """The answer computed again after a damaged stored prefix differs from the tokens already handed out."""


@dataclass
class _Stream:
    """The new tokens handed to `on_text` / `on_token`, across the attempts of one generation: an attempt after
    the first re-derives the tokens already handed out, which are checked instead of handed out again."""

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


@dataclass
class _Run:
    """One generation's settings; `once` answers the prompt in a fresh cache."""

    llm: object
    kv_config: KVConfig
    ids: torch.Tensor
    max_new_tokens: int
    chunk: int
    progress: bool
    watch: Watch | None
    choose: Callable[[torch.Tensor], int] | None
    eos: set[int]
    stream: _Stream

    def once(self, reuse: PromptReuse | None) -> GenerationResult | None:
        """The answer (ttft_s left to the caller), or None when a stored prefix the cache reads in place failed a
        check while decoding, or its sparse image while copied into the new entry (`recompute`): its entry is dropped
        and the match forgotten, so the next call answers cold."""
        model, kv_config = self.llm.model, self.kv_config
        prompt_in = _PromptIn(self)
        cache, logits, started = prompt_in.into_cache(reuse)
        self.stream.restart()
        try:
            with decoding(kv_config.kv):  # sparse: a core for the scorer process
                cache.place_prompt()  # under the decode's threads: the sparse path calibrates APP there
                try:
                    if isinstance(cache, SparseCache) and prompt_in.writer is not None:
                        _store_sparse_image(cache, prompt_in.writer)  # before a decode step changes the pools
                    prefilled = time.perf_counter()
                    new_ids = _decode(model, cache, logits, self.max_new_tokens, self.eos, self.stream, self.choose,
                                      self.watch)
                except (ChecksumError, CorruptEntry) as error:
                    if not _stored_failed(cache, error):
                        raise
                    _forget_damaged(reuse, prompt_in, error)
                    return None
            finished = time.perf_counter()
            kv_bytes = tier_bytes(cache, model)
            io = cache.io_stats()
            restarts = cache.runtime.scorer.restarts if isinstance(cache, SparseCache) else 0
        finally:
            if reuse is not None:
                reuse.publish(prompt_in.writer)
            cache.close()
        passes = max(len(new_ids) - 1, 1)
        return GenerationResult(
            text=self.llm.tokenizer.decode(new_ids, skip_special_tokens=True),
            token_ids=new_ids,
            kv_mode=kv_config.kv,
            prefill_tokens=self.ids.shape[1],
            decode_tokens=len(new_ids),
            prefill_s=prefilled - started,
            decode_s=finished - prefilled,
            ms_per_token=(finished - prefilled) * 1000 / passes,
            disk_bytes_read=io.bytes_read,
            disk_bytes_written=io.bytes_written,
            kv_bytes=kv_bytes,
            reused_prompt_tokens=prompt_in.reused,
            kv_store_bytes_read=reuse.bytes_read if reuse is not None else 0,
            scorer_restarts=restarts,
        )


@dataclass
class _PromptIn:
    """Puts one prompt into a fresh cache: the stored prefix loaded, the rest prefilled (and recorded)."""

    run: _Run
    reused: int = 0
    writer: EntryWriter | None = None

    def into_cache(self, reuse: PromptReuse | None) -> tuple[object, torch.Tensor, float]:
        """(cache, last logits, when the prefill started). A damaged stored prefix is recomputed once from scratch
        (`--on-corrupt recompute`) or raised (`fail`)."""
        run = self.run
        try:
            cache = make_cache(run.llm.model, run.kv_config, run.ids.shape[1] + run.max_new_tokens, run.ids.shape[0],
                               run.llm.model_id, reuse.match if reuse is not None else None)
        except (CorruptImage, CorruptEntry) as error:
            return self._recompute(reuse, error)
        started = time.perf_counter()
        try:
            if reuse is None:
                return cache, self._prefill(cache, 0), started
            with reuse.recording(cache) as writer:
                self.reused = reuse.replay(cache)
                if isinstance(cache, SparseCache) and cache.image is not None:
                    reuse.bytes_read += cache.image.bytes_read
                logits = self._prefill(cache, self.reused)
            self.writer = writer
            return cache, logits, started
        except CorruptEntry as error:
            cache.close()
            return self._recompute(reuse, error)
        except BaseException:
            cache.close()
            raise

    def discard_entry(self, reuse: PromptReuse) -> None:
        """Drop the entry this prompt was writing, unpublished."""
        if self.writer is not None:
            reuse.store.discard(self.writer)
            self.writer = None

    def _recompute(self, reuse: PromptReuse, error: CorruptEntry | CorruptImage) -> tuple[object, torch.Tensor, float]:
        """After a damaged entry: raise (`fail`, the entry kept), or remove it and prefill the whole prompt as if
        nothing were stored."""
        reuse.forget_damaged(error)
        return self.into_cache(reuse)

    def _prefill(self, cache, start: int) -> torch.Tensor:
        run = self.run
        ids = run.ids[:, start:].to(run.llm.model.device)
        return _prefill_with_progress(run.llm.model, ids, cache, run.chunk, run.progress, run.watch)


def _store_sparse_image(cache: SparseCache, writer: EntryWriter) -> None:
    """Add the placed tiers to the entry being written (from the stored image the cache uses, where its slots are
    still the image's); a failed write leaves the entry without them."""
    if writer.failure is not None:
        return
    try:
        cache.save_image(writer.directory / IMAGE_DIR, writer.blocks_written * writer.meta.block_tokens)
    except OSError as error:
        log.warning("cannot store the sparse tiers with the document (%s); it is stored without them",
                    error.strerror or error)


def _stored_failed(cache, error: StorageError) -> bool:
    """Whether `error` is about the stored files `cache` reads in place (sparse: the image; offload: the entry's
    K/V), not about the run's own files."""
    if isinstance(cache, SparseCache):
        stored = cache.image
    elif isinstance(cache, OffloadCache):
        stored = cache.store.base
    else:
        return False
    return stored is not None and stored.holds(error)


def _forget_damaged(reuse: PromptReuse, prompt_in: _PromptIn, error: StorageError) -> None:
    """After a stored prefix failed a check (while decoding, or a sparse image copied into the entry being written):
    the entry being written is dropped (it may hold copies of the damaged records); `fail` raises the error and
    keeps the damaged entry, `recompute` removes it and forgets the match, so the prompt is answered again cold."""
    prompt_in.discard_entry(reuse)
    reuse.forget_damaged(error)


def _decode(model, cache, logits, max_new_tokens: int, eos: set[int], stream: _Stream, choose, watch) -> list[int]:
    """Decode loop; stops at an end-of-sequence token (kept in the ids, as transformers does). Returns the ids."""
    new_ids: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits.argmax(dim=-1)[0]) if choose is None else choose(logits)
        new_ids.append(token)
        stopped = watch is not None and watch(cache)
        stream.put(token)
        if token in eos or len(new_ids) == max_new_tokens or stopped:
            break
        step = torch.tensor([[token]], device=model.device)
        logits = model(input_ids=step, cache=cache, use_cache=True).logits[:, -1, :]
    return new_ids
