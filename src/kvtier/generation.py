"""Greedy generation with a chosen KV mode: chunked prefill with progress, streamed decode, measured summary."""

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from kvtier.docstore.document_store import DocumentStore, Match
from kvtier.docstore.recovery import AnswerStream, PromptIn, StoredPrefixDropped
from kvtier.docstore.reuse import PromptReuse
from kvtier.kv.contract import tier_bytes
from kvtier.models.loader import LoadedModel
from kvtier.models.prompts import check_context, prompt_ids
from kvtier.modes import KVConfig, make_cache
from kvtier.sparse import decoding

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
    # sparse mode: the estimated attention mass kept (mean, least), the share of pooled tokens attended and the
    # top-p guard's events over the decode steps (KVCache.attention_budget); None for the other modes
    attention_budget: dict | None = None

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
    tokenizer=None,
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
    not handed out again (kvtier.docstore.recovery). `llm`: a kvtier.load_model() result, or a transformers model
    with its `tokenizer` (default: the one saved beside its weights; LoadedModel.wrap).
    """
    kv_config = (kv_config or KVConfig()).validated()
    llm = LoadedModel.wrap(llm, tokenizer)
    ids = prompt_ids(llm, prompt) if input_ids is None else input_ids
    check_context(llm, ids.shape[1], max_new_tokens)
    requested = time.perf_counter()
    reuse = PromptReuse.plan(kv_store, llm, ids, prompt) if kv_store is not None else None
    eos = _eos_ids(llm) if eos_token_ids is None else eos_token_ids
    run = _Run(llm, kv_config, ids, max_new_tokens, prefill_chunk, progress, watch, choose, eos,
               AnswerStream(llm.tokenizer, on_text, on_token))
    with torch.inference_mode():
        try:
            result = run.once(reuse)
        except StoredPrefixDropped:  # a stored prefix failed a check after the prompt went in: its entry is gone
            result = run.once(reuse)
    result.ttft_s = run.stream.first_at - requested
    return result


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
    stream: AnswerStream

    def once(self, reuse: PromptReuse | None) -> GenerationResult:
        """The answer (ttft_s left to the caller). Raises StoredPrefixDropped when a stored prefix the cache reads in
        place failed a check while decoding, or its sparse image while copied into the new entry (`recompute`): its
        entry is dropped and the match forgotten, so the next call answers cold."""
        model, kv_config = self.llm.model, self.kv_config
        prompt_in = PromptIn(reuse, self._new_cache, self._prefill)
        cache, logits, started = prompt_in.into_cache()
        self.stream.restart()
        try:
            with decoding(kv_config.kv):  # sparse: a core for the scorer process
                cache.place_prompt()  # under the decode's threads: the sparse path calibrates APP there
                with prompt_in.decoding(cache):
                    prefilled = time.perf_counter()
                    new_ids = _decode(model, cache, logits, self.max_new_tokens, self.eos, self.stream, self.choose,
                                      self.watch)
            finished = time.perf_counter()
            kv_bytes = tier_bytes(cache, model)
            io = cache.io_stats()
            restarts = cache.scorer_restarts()
            budget = cache.attention_budget()
        finally:
            prompt_in.publish()
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
            attention_budget=budget,
        )

    def _new_cache(self, stored: Match | None):
        return make_cache(self.llm.model, self.kv_config, self.ids.shape[1] + self.max_new_tokens, self.ids.shape[0],
                          self.llm.model_id, stored)

    def _prefill(self, cache, start: int) -> torch.Tensor:
        ids = self.ids[:, start:].to(self.llm.model.device)
        return _prefill_with_progress(self.llm.model, ids, cache, self.chunk, self.progress, self.watch)


def _decode(model, cache, logits, max_new_tokens: int, eos: set[int], stream: AnswerStream, choose, watch) -> list[int]:
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
