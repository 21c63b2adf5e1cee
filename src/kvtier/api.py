"""The Python API in one place: load a model, generate with a KV mode, or get a Cache for model.generate."""

from kvtier.generation import GenerationResult, generate
from kvtier.models.loader import LoadedModel, load_model
from kvtier.models.prompts import prompt_ids
from kvtier.modes import KVConfig
from kvtier.modes import make_cache as _make_cache_for_model


def make_cache(llm: LoadedModel, kv_config: KVConfig | None = None, max_tokens: int | None = None, batch_size: int = 1):
    """A transformers Cache for `llm.model(..., cache=...)` / `llm.model.generate(..., cache=...)`.

    `max_tokens` (prompt + new tokens per sequence) sizes the KV file of an offload cache; it
    defaults to the model's context length. Offload caches own a file: call `cache.close()`.
    """
    return _make_cache_for_model(
        llm.model, kv_config or KVConfig(), max_tokens or llm.context_length, batch_size, llm.model_id
    )


__all__ = ["GenerationResult", "KVConfig", "LoadedModel", "generate", "load_model", "make_cache", "prompt_ids"]
