"""The served model behind the endpoints: tokenizing, the context checks, and which path runs a request.

A request goes to the continuous-batching engine when its prompt plus `max_tokens` fits the
device pool (the engine's own admission rule), otherwise to the sparse path; a request beyond the
model's context is refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.modes import KVConfig
from kvtier.engine.block_manager import blocks_for
from kvtier.engine.serving_engine import EngineConfig, LLMEngine
from kvtier.engine.sequence import SamplingParams
from kvtier.http.engine_loop import EngineLoop
from kvtier.http.error_responses import APIError
from kvtier.http.metrics import ServerMetrics
from kvtier.http.sparse_path import SparseCounters, SparsePath
from kvtier.http.token_stream import TokenStream
from kvtier.docstore.document_store import DocumentStore

PAGED, SPARSE = "paged", "sparse"


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # what /v1/models lists and requests must name
    api_key: str | None = None
    default_max_tokens: int = 256  # when a request gives no max_tokens


class Backend:
    """Owns the engine loop and the sparse path; `close()` stops both and closes the engine (and its flash file)."""

    def __init__(self, llm: Any, engine: LLMEngine, sparse: SparsePath | None, settings: ServerSettings) -> None:
        self.llm = llm
        self.settings = settings
        self.engine = engine
        self.engine_loop = EngineLoop(engine)
        self.sparse = sparse
        self.metrics = ServerMetrics(lambda: self.engine_loop.snapshot,
                                     lambda: sparse.counters if sparse else SparseCounters())

    # ----- prompts -----

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.llm.has_chat_template:
            raise APIError(400, f"model {self.settings.model_name} has no chat template; use /v1/completions",
                           "messages", "no_chat_template")
        ids = self.llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def text_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.llm.tokenizer(prompt)["input_ids"])
        vocab = len(self.llm.tokenizer)
        if any(not 0 <= token < vocab for token in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt", "invalid_value")
        return list(prompt)

    def decode(self, ids: list[int]) -> str:
        return self.llm.tokenizer.decode(ids, skip_special_tokens=True)

    # ----- paths -----

    def route(self, prompt_tokens: int, max_tokens: int) -> str:
        """PAGED or SPARSE for a request of this size; APIError when no path can serve it."""
        context = self.llm.context_length
        if prompt_tokens >= context:
            raise APIError(400, f"the prompt has {prompt_tokens} tokens; the model's context is {context}",
                           "prompt", "context_length_exceeded")
        if prompt_tokens + max_tokens > context:
            raise APIError(400, f"max_tokens {max_tokens} + the prompt's {prompt_tokens} tokens exceed the model's "
                                f"{context}-token context; lower max_tokens to at most {context - prompt_tokens}",
                           "max_tokens", "context_length_exceeded")
        pool = self.engine.block_manager
        if blocks_for(prompt_tokens + max_tokens, pool.block_tokens) <= pool.num_blocks:
            return PAGED
        if self.sparse is None:
            raise APIError(400, f"prompt + max_tokens = {prompt_tokens + max_tokens} tokens exceed the device pool "
                                f"({pool.num_blocks * pool.block_tokens} tokens) and the sparse path is off",
                           "prompt", "context_length_exceeded")
        return SPARSE

    def start(self, path: str, ids: list[int], sampling: SamplingParams) -> TokenStream:
        stream = TokenStream(asyncio.get_running_loop())
        if path == PAGED:
            self.engine_loop.submit(ids, sampling, stream)
        else:
            self.sparse.submit(ids, sampling, stream)
        self.metrics.requests.labels(path).inc()
        self.metrics.prompt_tokens.inc(len(ids))
        return stream

    def cancel(self, path: str, stream: TokenStream) -> None:
        """Stop generating for `stream` and free what its request holds."""
        stream.cancel()
        if path == PAGED:
            self.engine_loop.abort(stream)
        else:
            self.sparse.abort(stream)

    def fail_unfinished(self) -> None:
        """The shutdown's grace period is over: fail every unfinished request now (each client gets a 503 error
        body, "the server is shutting down"); returns at once, for the event loop's thread."""
        self.engine_loop.stop(wait=False)
        if self.sparse is not None:
            self.sparse.fail_all()

    def close(self) -> None:
        self.engine_loop.stop()
        if self.sparse is not None:
            self.sparse.stop()
        self.engine.close()


@dataclass(frozen=True)
class SparseSetup:
    """The sparse path's KV tiers, a loader of its own model instance, and the document KV store (None: none)."""

    kv_config: KVConfig
    load_model: Callable[[], Any]
    store: DocumentStore | None = None


def build_backend(llm: Any, engine_config: EngineConfig, settings: ServerSettings,
                  sparse: SparseSetup | None = None) -> Backend:
    """A backend for `llm`: an engine with `engine_config`, and the sparse path unless `sparse` is None."""
    engine = LLMEngine.from_llm(llm, engine_config)
    path = None
    if sparse is not None:
        path = SparsePath(sparse.load_model, sparse.kv_config, engine.eos_token_ids, sparse.store)
    return Backend(llm, engine, path, settings)
