"""Prompts too long for the engine's paged budget, served on the HillInfer sparse path one at a time.

The sparse path (`--kv sparse`) keeps a window of the KV on the device, a hot pool in host DRAM
and a cold pool on disk scored by the storage scorer process; it is built for one long sequence,
so requests queue for a single worker thread. It runs on a model instance of its own, loaded on
the first long request: the engine has installed its paged attention on the serving model.
With a document KV store (`kvtier.store`), a prompt whose leading blocks were stored by an earlier
request loads that prefix instead of prefilling it, and a new prompt is stored for the next one.
While it decodes, the process runs one torch thread fewer (`kvtier.threads`: the scorer process
needs a core), which slows the engine's concurrent steps as well: torch's thread count is global.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvtier.errors import KvtierError
from kvtier.generation import GenerationResult, generate
from kvtier.modes import KVConfig
from kvtier.serve.sampler import Sampler
from kvtier.serve.sequence import SamplingParams
from kvtier.server.token_stream import TokenStream
from kvtier.store.store import DocumentStore

log = logging.getLogger(__name__)
HEAD_TOKENS = 256


@dataclass
class SparseCounters:
    """Totals over every sparse request so far (read by /metrics)."""

    running: int = 0
    waiting: int = 0
    requests: int = 0
    cold_read_bytes: int = 0
    scorer_restarts: int = 0
    reused_prompt_tokens: int = 0
    kv_store_bytes_read: int = 0


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
        self._lock = threading.Lock()  # counters are bumped from the handlers' and the worker's threads
        self._unfinished: set[TokenStream] = set()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-sparse")

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, stream: TokenStream) -> None:
        with self._lock:
            self._unfinished.add(stream)
        self._count(waiting=1)
        self._worker.submit(self._serve, prompt_ids, sampling, stream)

    def stop(self) -> None:
        """End the request being served after its current token, and fail the queued ones."""
        with self._lock:
            unfinished = list(self._unfinished)
        for stream in unfinished:
            stream.cancel()
        self._worker.shutdown(wait=True, cancel_futures=True)
        for stream in self._unfinished:  # queued, never started
            stream.finish("abort", "the server is shutting down")

    def _serve(self, prompt_ids: list[int], sampling: SamplingParams, stream: TokenStream) -> None:
        self._count(waiting=-1, running=1)
        with self._lock:
            self._unfinished.discard(stream)
        try:
            if stream.cancelled:
                stream.finish("abort")
                return
            result = self._generate(prompt_ids, sampling, stream)
        except KvtierError as error:
            stream.finish("error", str(error))
        except Exception as error:  # a failure of one long request must not stop the server
            log.exception("sparse-path request failed")
            stream.finish("error", f"sparse path failed: {error}")
        else:
            self._count(requests=1, cold_read_bytes=result.disk_bytes_read, scorer_restarts=result.scorer_restarts,
                        reused_prompt_tokens=result.reused_prompt_tokens,
                        kv_store_bytes_read=result.kv_store_bytes_read)
            stream.finish(self._finish_reason(result, stream))
        finally:
            self._count(running=-1)

    def _generate(self, prompt_ids: list[int], sampling: SamplingParams, stream: TokenStream) -> GenerationResult:
        if self._llm is None:
            self._llm = self._load_model()
        sampler = Sampler()

        def on_token(token: int) -> bool:
            stream.push(token)
            return stream.cancelled

        head = self._llm.tokenizer.decode(prompt_ids[:HEAD_TOKENS])  # the store describes entries by their start
        return generate(self._llm, head, sampling.max_new_tokens, self.kv_config, progress=False,
                        input_ids=torch.tensor([prompt_ids]), kv_store=self.store, on_token=on_token,
                        choose=lambda logits: sampler.choose(logits, [(0, sampling)])[0])

    def _finish_reason(self, result: GenerationResult, stream: TokenStream) -> str:
        if stream.cancelled:
            return "abort"
        if result.token_ids and result.token_ids[-1] in self._eos:
            return "stop"
        return "length"

    def _count(self, **changes: int) -> None:
        with self._lock:
            for name, change in changes.items():
                setattr(self.counters, name, getattr(self.counters, name) + change)
