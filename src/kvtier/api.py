"""The Python API in one place: load a model, generate with a KV mode (reusing documents through a `DocumentStore`:
`DocumentStore()` is the command line's store), or get a Cache for model.generate."""

from kvtier.docstore.document_store import DocumentStore
from kvtier.generation import GenerationResult, generate
from kvtier.kv.contract import KVCache
from kvtier.models.loader import LoadedModel, load_model
from kvtier.models.prompts import prompt_ids
from kvtier.modes import KVConfig
from kvtier.modes import make_cache as _make_cache_for_model


def make_cache(llm, kv_config: KVConfig | None = None, max_tokens: int | None = None, batch_size: int = 1) -> KVCache:
    """A transformers Cache for `model(..., cache=...)` / `model.generate(..., cache=...)`.

    `llm` is a kvtier `LoadedModel` or a model loaded with transformers (`AutoModelForCausalLM`).
    `max_tokens` (prompt + new tokens per sequence) sizes the cache's files; it defaults to the
    model's context length. Tiered caches own files: call `cache.close()`, or use the cache as a
    context manager.
    """
    llm = LoadedModel.wrap(llm, need_tokenizer=False)
    return _make_cache_for_model(llm.model, kv_config or KVConfig(), max_tokens or llm.context_length, batch_size,
                                 llm.model_id)


__all__ = ["DocumentStore", "GenerationResult", "KVConfig", "LoadedModel", "generate", "load_model", "make_cache",
           "prompt_ids"]
