"""The served model behind the endpoints: tokenizing, the context checks, and the engine that runs every request.

Every request is a sequence of the one continuous-batching engine. One whose prompt plus
`max_tokens` fits the device pool is paged; a longer one is tiered (HillInfer's tiers under the
engine, kvtier.engine.tiered) when the server has tiers, else refused; a request beyond the model's
context is refused.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any

from kvtier.engine.block_manager import blocks_for
from kvtier.engine.grammar import GrammarCompiler
from kvtier.engine.sequence import SamplingParams
from kvtier.engine.serving_engine import EngineConfig, LLMEngine
from kvtier.http.engine_loop import EngineLoop
from kvtier.http.error_responses import APIError
from kvtier.http.metrics import ServerMetrics
from kvtier.http.token_stream import TokenStream
from kvtier.tiered_kv import SparseTiers
from kvtier.units import counted

PAGED, TIERED = "paged", "tiered"


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # what /v1/models lists and requests must name
    api_key: str | None = None
    default_max_tokens: int = 256  # when a request gives no max_tokens


class Backend:
    """Owns the engine loop; `close()` stops it and closes the engine (its flash file, its tiered sequences)."""

    def __init__(self, llm: Any, engine: LLMEngine, settings: ServerSettings) -> None:
        self.llm = llm
        self.settings = settings
        self.engine = engine
        self.vocab_size = llm.model.get_output_embeddings().weight.shape[0]  # the logits' width
        self.grammars = GrammarCompiler(llm.tokenizer, self.vocab_size, sorted(engine.eos_token_ids))
        self.metrics = ServerMetrics(lambda: self.engine_loop.snapshot)
        self.engine_loop = EngineLoop(engine, self.metrics.queue_time.observe)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)

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

    def _token_text(self, token_id: int) -> str:
        """One token as log-probabilities show it: decoded alone, special tokens included."""
        return self.llm.tokenizer.decode([token_id], skip_special_tokens=False)

    # ----- requests -----

    def route(self, prompt_tokens: int, max_tokens: int) -> str:
        """PAGED or TIERED (how the engine will hold the request's KV); APIError when it cannot be served."""
        context = self.llm.context_length
        if prompt_tokens >= context:
            raise APIError(400, f"the prompt has {prompt_tokens} tokens; the model's context is {context}",
                           "prompt", "context_length_exceeded")
        if prompt_tokens + max_tokens > context:
            raise APIError(400, f"max_tokens {max_tokens} + the prompt's {counted(prompt_tokens, 'token')} exceed "
                                f"the model's {context}-token context; lower max_tokens to at most "
                                f"{context - prompt_tokens}",
                           "max_tokens", "context_length_exceeded")
        pool = self.engine.block_manager
        if blocks_for(prompt_tokens + max_tokens, pool.block_tokens) <= pool.num_blocks:
            return PAGED
        if self.engine.tiers is None:
            raise APIError(400, f"prompt + max_tokens = {prompt_tokens + max_tokens} tokens exceed the device pool "
                                f"({pool.num_blocks * pool.block_tokens} tokens) and long prompts are off",
                           "prompt", "context_length_exceeded")
        return TIERED

    def start(self, path: str, ids: list[int], sampling: SamplingParams) -> TokenStream:
        stream = TokenStream(asyncio.get_running_loop())
        self.engine_loop.submit(ids, sampling, stream)
        self.metrics.requests.labels(path).inc()
        self.metrics.prompt_tokens.inc(len(ids))
        return stream

    def cancel(self, stream: TokenStream, index: int | None = None) -> None:
        """Stop generating for `stream` (or only its choice `index`) and free what it holds."""
        if index is None:
            stream.cancel()
        self.engine_loop.abort(stream, index)

    def fail_unfinished(self) -> None:
        """The shutdown's grace period is over: fail every unfinished request now (each client gets a 503 error
        body, "the server is shutting down"); returns at once, for the event loop's thread."""
        self.engine_loop.stop(wait=False)

    def close(self) -> None:
        self.engine_loop.stop()
        self.engine.close()


def build_backend(llm: Any, engine_config: EngineConfig, settings: ServerSettings,
                  tiers: SparseTiers | None = None) -> Backend:
    """A backend for `llm`: an engine with `engine_config`, serving long prompts as tiered sequences unless `tiers` is
    None (build `tiers` first: the engine replaces the model's attention)."""
    return Backend(llm, LLMEngine.from_llm(llm, engine_config, tiers), settings)
