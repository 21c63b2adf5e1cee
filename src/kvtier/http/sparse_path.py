"""Prompts too long for the engine's paged budget, served on the HillInfer sparse path one at a time.

The sparse path (`--kv sparse`) keeps a window of the KV on the device, a hot pool in host DRAM
and a cold pool on disk scored by the storage scorer process; it is built for one long sequence,
so requests queue for a single worker thread. It runs on a model instance of its own, loaded on
the first long request: the engine has installed its paged attention on the serving model.
With a document KV store (`kvtier.docstore`), a prompt whose leading blocks were stored by an earlier
request loads that prefix instead of prefilling it, and a new prompt is stored for the next one.
After every prefill chunk and every token the worker reads the cache's tiers (KV bytes on the
device, in host DRAM, on disk), cold-pool reads and scorer restarts into `counters`, which /metrics
reports; the tiers drop back to zero when the request ends. An aborted request (its client went
away, or the server stops) leaves the queue at once, or ends at the next of those points.
While it decodes, the process runs one torch thread fewer (`kvtier.sparse.threads`: the scorer process
needs a core, which the worker thread leaves to it), which slows the engine's concurrent steps as
well: torch's thread count is global.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvtier.errors import KvtierError
from kvtier.generation import GenerationCancelled, GenerationResult, generate
from kvtier.kv.contract import TIERS, tier_bytes
from kvtier.modes import KVConfig
from kvtier.engine.sampler import Sampler
from kvtier.engine.sequence import SamplingParams
from kvtier.http.token_stream import SHUTTING_DOWN, Finished, TokenStream
from kvtier.docstore.document_store import DocumentStore

log = logging.getLogger(__name__)
HEAD_TOKENS = 256


@dataclass
class SparseCounters:
    """Totals over every sparse request so far, and the tiers of the one being served (read by /metrics)."""

    running: int = 0
    waiting: int = 0
    requests: int = 0
    cold_read_bytes: int = 0
    scorer_restarts: int = 0
    reused_prompt_tokens: int = 0
    kv_store_bytes_read: int = 0
    kv_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))


class SparsePath:
    """A one-thread queue of long requests; `load_model()` gives the path's model on first use."""

    def __init__(self, load_model: Callable[[], object], kv_config: KVConfig, eos_token_ids: set[int],
                 store: DocumentStore | None = None) -> None:
        self.kv_config = kv_config.validated()
        self.store = store
        self.counters = SparseCounters()
        self._load_model = load_model
        self._llm = None
        self._eos = eos_token_ids
        self._lock = threading.Lock()  # guards the counters and the queue (handlers' and the worker's threads)
        self._queued: set[TokenStream] = set()
        self._serving: TokenStream | None = None
        self._stopping = False
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-sparse")

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, stream: TokenStream) -> None:
        with self._lock:
            self._queued.add(stream)
            self.counters.waiting += 1
        self._worker.submit(self._serve, prompt_ids, sampling, stream)

    def abort(self, stream: TokenStream) -> None:
        """End the stream's request: a queued one leaves the queue now, the one being served stops at its next token
        (or prefill chunk); safe to call more than once."""
        stream.cancel()
        with self._lock:
            if stream not in self._queued:  # being served (it sees `cancelled`), or done
                return
            self._queued.discard(stream)
            self.counters.waiting -= 1
        finished = self._aborted()
        stream.finish(finished.reason, finished.error)

    def fail_all(self) -> None:
        """Abort every unfinished request with a message ("the server is shutting down"); returns at once."""
        self._stopping = True
        with self._lock:
            unfinished = [*self._queued, *filter(None, [self._serving])]
        for stream in unfinished:
            self.abort(stream)

    def stop(self) -> None:
        """`fail_all`, then wait for the request being served to end."""
        self.fail_all()
        self._worker.shutdown(wait=True)

    def _serve(self, prompt_ids: list[int], sampling: SamplingParams, stream: TokenStream) -> None:
        with self._lock:
            if stream not in self._queued:  # aborted while it was queued
                return
            self._queued.discard(stream)
            self._serving = stream
            self.counters.waiting -= 1
            self.counters.running += 1
        finished = self._aborted()
        try:
            result = self._generate(prompt_ids, sampling, stream)
            self._count(requests=1, reused_prompt_tokens=result.reused_prompt_tokens,
                        kv_store_bytes_read=result.kv_store_bytes_read)
            finished = self._outcome(result, sampling, stream)
        except GenerationCancelled:
            pass  # cancelled during its prefill
        except KvtierError as error:
            finished = Finished("error", str(error))
        except Exception as error:  # a failure of one long request must not stop the server
            log.exception("sparse-path request failed")
            finished = Finished("error", f"sparse path failed: {error}")
        finally:
            with self._lock:  # idle again before the client hears the end
                self._serving = None
                self.counters.running -= 1
                self.counters.kv_bytes = dict.fromkeys(TIERS, 0)
            stream.finish(finished.reason, finished.error)

    def _generate(self, prompt_ids: list[int], sampling: SamplingParams, stream: TokenStream) -> GenerationResult:
        if self._llm is None:
            self._llm = self._load_model()
        sampler = Sampler()
        head = self._llm.tokenizer.decode(prompt_ids[:HEAD_TOKENS])  # the store describes entries by their start
        return generate(self._llm, head, sampling.max_new_tokens, self.kv_config, progress=False,
                        input_ids=torch.tensor([prompt_ids]), kv_store=self.store, on_token=stream.push,
                        choose=lambda logits: sampler.choose(logits, [(0, sampling)])[0],
                        watch=_Watch(self, stream, self._llm.model),
                        eos_token_ids=set() if sampling.ignore_eos else self._eos)

    def _outcome(self, result: GenerationResult, sampling: SamplingParams, stream: TokenStream) -> Finished:
        if stream.cancelled:
            return self._aborted()
        if not sampling.ignore_eos and result.token_ids[-1] in self._eos:  # the engine's rule
            return Finished("stop")
        return Finished("length")

    def _aborted(self) -> Finished:
        return Finished("abort", SHUTTING_DOWN if self._stopping else None)

    def _observe(self, kv_bytes: dict[str, int], cold_read_bytes: int, scorer_restarts: int) -> None:
        with self._lock:
            self.counters.kv_bytes = kv_bytes
            self.counters.cold_read_bytes += cold_read_bytes
            self.counters.scorer_restarts += scorer_restarts

    def _count(self, **changes: int) -> None:
        with self._lock:
            for name, change in changes.items():
                setattr(self.counters, name, getattr(self.counters, name) + change)


class _Watch:
    """`generate`'s watch for one request: publishes its cache's tiers and I/O so far; True once it is cancelled."""

    def __init__(self, path: SparsePath, stream: TokenStream, model: torch.nn.Module) -> None:
        self._path, self._stream, self._model = path, stream, model
        self._cache: object | None = None
        self._read = self._restarts = 0  # of `_cache`, already counted

    def __call__(self, cache) -> bool:
        if cache is not self._cache:  # a damaged stored prefix makes generate start over in a fresh cache
            self._cache, self._read, self._restarts = cache, 0, 0
        read, restarts = cache.io_stats().bytes_read, cache.runtime.scorer.restarts  # a SparseCache
        self._path._observe(tier_bytes(cache, self._model), read - self._read, restarts - self._restarts)
        self._read, self._restarts = read, restarts
        return self._stream.cancelled
