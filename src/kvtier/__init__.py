"""kvtier: a tiered KV-cache runtime for long-context LLM inference.

Public API (README "Python"; kvtier.api): load_model, generate, make_cache, prompt_ids, KVConfig, DocumentStore.
They are imported lazily so that `import kvtier.storage` stays free of torch and transformers.
"""

__version__ = "0.1.0"

_API = ("DocumentStore", "GenerationResult", "KVConfig", "LoadedModel", "generate", "load_model", "make_cache",
        "prompt_ids")


def __getattr__(name: str):
    if name in _API:
        from kvtier import api

        return getattr(api, name)
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
