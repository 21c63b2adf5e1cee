"""KV budgets of an evaluation cell, sized from the prompt's own KV so that most of it lives off the device.

The host budget is a share of the prompt's KV (default 40%, as `kvtier bench sparse`), so
more than half of the prompt's KV goes to the storage tier; the device budget is a small
share with a floor of `MIN_DEVICE_TOKENS` tokens, what every tiered mode needs (offload: one
block for new tokens; sparse: the sink + recent window).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.kv.model_geometry import full_attention_layers, model_geometry, text_config
from kvtier.kv_config import KVConfig

MIN_DEVICE_TOKENS = 128


@dataclass(frozen=True)
class BudgetShares:
    """Budgets as shares of the prompt's KV bytes (over the tiered layers)."""

    host: float = 0.4
    device: float = 0.02

    def as_dict(self) -> dict[str, float | int]:
        return {"host_share": self.host, "device_share": self.device, "min_device_tokens": MIN_DEVICE_TOKENS}


def kv_bytes_per_token(model) -> int:
    """K+V bytes of one token over the tiered (full-attention) layers, in the model's dtype."""
    return model_geometry(model, full_attention_layers(text_config(model))).token_bytes


def budget_bytes(model, prompt_tokens: int, shares: BudgetShares, batch: int = 1) -> tuple[int, int]:
    """(device, host) KV budget bytes for `batch` prompts of `prompt_tokens` tokens each."""
    per_token = kv_bytes_per_token(model) * batch
    device = max(int(shares.device * prompt_tokens * per_token), MIN_DEVICE_TOKENS * per_token)
    return device, int(shares.host * prompt_tokens * per_token)


def cell_kv_config(mode: str, model, prompt_tokens: int, shares: BudgetShares, **options) -> KVConfig:
    """The KVConfig of `mode` for a prompt of `prompt_tokens` tokens; `options` are further KVConfig fields."""
    device, host = budget_bytes(model, prompt_tokens, shares)
    return KVConfig(kv=mode, device_kv_budget=device, host_kv_budget=host, **options).validated()
