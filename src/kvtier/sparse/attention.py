"""The attention function that routes decode steps of tiered layers to SparseLayer.attend.

transformers calls `cache.update(...)` and then the model's attention
function with whatever update returned. The sparse cache's update leaves a
*hand-off* (the key tensor it returned and the layer); the attention function
recognises that exact tensor object and, for a one-token query of a tiered
layer, lets the layer select, fetch and attend. Everything else (prefill,
sliding-window layers, other caches) goes to the model's original attention
implementation untouched, so installing is harmless for dense runs.

The function is registered as `kvtier_sparse_<inner>` (e.g. `kvtier_sparse_sdpa`)
together with the inner implementation's mask function: without a registered
mask function the mask would arrive as None and sliding-window layers would
silently attend to everything. Installing is permanent for a
model (it only delegates when no sparse cache is active).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvtier.errors import ConfigError
from kvtier.sparse.threads import LAYER_STEP_THREADS, torch_threads

if TYPE_CHECKING:
    from kvtier.sparse.layer import SparseLayer

PREFIX = "kvtier_sparse_"
_handoff: tuple[torch.Tensor, SparseLayer | None] | None = None


def hand_off(keys: torch.Tensor, layer: SparseLayer | None) -> None:
    """Record what the cache's update just returned (layer None: not tiered, attend normally)."""
    global _handoff
    _handoff = (keys, layer)


def clear_hand_off() -> None:
    global _handoff
    _handoff = None


def _sparse_attention(inner_name: str) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        inner = ALL_ATTENTION_FUNCTIONS[inner_name]
        handoff = _handoff
        if handoff is None or handoff[0] is not key or handoff[1] is None:
            return inner(module, query, key, value, attention_mask, **kwargs)
        layer = handoff[1]
        if query.shape[2] > 1 or not layer.distributed:
            scaling = kwargs.get("scaling")
            layer.observe(query, scaling if scaling is not None else query.shape[-1] ** -0.5)
            return inner(module, query, key, value, attention_mask, **kwargs)
        with torch_threads(LAYER_STEP_THREADS):  # small products: a helper would only add a wait (kvtier.sparse.threads)
            return layer.attend(module, query, attention_mask, inner, **kwargs)

    return attention


def install(model) -> None:
    """Route `model`'s attention through the sparse hand-off (idempotent)."""
    current = model.config._attn_implementation or "sdpa"
    if current.startswith(PREFIX):
        return
    model.set_attn_implementation(_register(current))


def function(inner_name: str) -> Callable:
    """The sparse hand-off around attention implementation `inner_name`, for a caller that routes attention itself
    (the serving engine calls it per tiered sequence): called after the cache's `update`, with what it returned."""
    return ALL_ATTENTION_FUNCTIONS[_register(inner_name)]


def _register(inner_name: str) -> str:
    """Register `kvtier_sparse_<inner_name>` with its mask function (idempotent); its name."""
    if inner_name not in ALL_ATTENTION_FUNCTIONS or inner_name not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ConfigError(f"the sparse KV mode cannot wrap attention implementation {inner_name!r}; "
                          "load the model with attn_implementation='sdpa' or 'eager'")
    name = PREFIX + inner_name
    AttentionInterface.register(name, _sparse_attention(inner_name))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner_name])
    return name
