"""Recall of attention mass: how much of dense attention falls on the tokens a KV mode attended.

For one decode step of one layer, dense attention gives each query head h a probability
P_h(p) per position p (softmax over every key). A selective mode attends a set A of
positions; its attention-mass recall is the mean over query heads of sum_{p in A} P_h(p):
1.0 when it attends everything, the share of dense attention it kept otherwise.

`DenseAttentionProbe` captures a dense cache's one-token queries and full keys per layer
while a forward pass runs (an attention-function wrapper around the model's current one);
`AttendedPositions` collects what a mode's cache reports through `watch_attended`.
Modes that attend every position exactly (`kvtier.kv_config.EXACT_MODES`) have recall 1.0 by definition.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvtier.kv.contract import SelectiveKVCache
from kvtier.eval.accuracy.recall import exact_mass

PROBE_PREFIX = "kvtier_probe_"


def reports_attended(cache) -> bool:
    """Whether a cache can say which positions each decode step attends (`watch_attended`)."""
    return isinstance(cache, SelectiveKVCache)


def mass_recall(query: torch.Tensor, keys: torch.Tensor, scaling: float, positions: torch.Tensor) -> float:
    """Mean over query heads and sequences of the dense attention mass on `positions`.

    Args:
        query: one decode query [B, Hq, 1, D].
        keys: every key of the layer, un-repeated [B, Hkv, N, D].
        scaling: the attention's score scale (1/sqrt(D) unless the model says otherwise).
        positions: attended positions [B, n] (indices into N).
    """
    heads = query.shape[1]
    recalls = [exact_mass(query[b, :, 0].cpu(), keys[b].cpu(), scaling)[positions[b].numpy()].sum() / heads
               for b in range(query.shape[0])]
    return float(np.mean(recalls))


class AttendedPositions:
    """The `watch_attended` callback of a mode's cache: the latest positions [B, n] per layer."""

    def __init__(self) -> None:
        self.by_layer: dict[int, torch.Tensor] = {}

    def __call__(self, layer_idx: int, positions) -> None:
        self.by_layer[layer_idx] = torch.as_tensor(np.asarray(positions), dtype=torch.int64)

    def take(self) -> dict[int, torch.Tensor]:
        """What the last step reported, emptied for the next step."""
        taken, self.by_layer = self.by_layer, {}
        return taken


class DenseAttentionProbe:
    """Context manager: wraps `model`'s attention so that `capturing()` passes record queries and keys.

    Outside `capturing()` the wrapper only delegates, so the same model also runs the mode's cache
    in lockstep. Install it after the mode's cache is built (a cache may install its own attention
    function); on exit the previous attention implementation is restored.
    """

    def __init__(self, model) -> None:
        self.model = model
        self.active = False
        self.captured: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}
        self.previous: str | None = None

    def __enter__(self) -> DenseAttentionProbe:
        self.previous = self.model.config._attn_implementation or "sdpa"
        name = PROBE_PREFIX + self.previous
        AttentionInterface.register(name, self._wrapped(self.previous))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[self.previous])
        self.model.set_attn_implementation(name)
        return self

    def __exit__(self, *exc) -> None:
        self.model.set_attn_implementation(self.previous)

    @contextmanager
    def capturing(self):
        """Record the one-token queries (and the keys they see) of the forward passes inside."""
        self.captured, self.active = {}, True
        try:
            yield self
        finally:
            self.active = False

    def recall(self, attended: dict[int, torch.Tensor]) -> dict[int, float]:
        """Attention-mass recall per reported layer, against the queries and keys captured last."""
        return {layer: mass_recall(*self.captured[layer], positions) for layer, positions in attended.items()}

    def _wrapped(self, inner_name: str):
        def attention(module, query, key, value, attention_mask, **kwargs):
            if self.active and query.shape[2] == 1:
                scaling = kwargs.get("scaling")
                scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
                self.captured[module.layer_idx] = (query, key, scaling)
            return ALL_ATTENTION_FUNCTIONS[inner_name](module, query, key, value, attention_mask, **kwargs)

        return attention
