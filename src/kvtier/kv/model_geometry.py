"""A loaded torch model's KV geometry: the one place that reads a model config's KV shape and dtype."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.storage import KVGeometry


def text_config(model):
    """The decoder config of `model` (multimodal models keep it under their text config)."""
    return model.config.get_text_config(decoder=True)


def full_attention_layers(config) -> list[int]:
    """Layers whose KV grows with the context (tiered); sliding-window layers stay on the device."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [i for i, kind in enumerate(layer_types) if kind != "sliding_attention"]


def model_geometry(model, layers: Sequence[int] | None = None) -> KVGeometry:
    """K/V geometry of `model` in its dtype: over all its layers, or over `layers` only (the tiered ones)."""
    geometry = KVGeometry.from_config(text_config(model), str(model.dtype))
    if layers is None:
        return geometry
    return KVGeometry(len(layers), geometry.num_kv_heads, geometry.head_dim, geometry.dtype)
