"""One dense prefill of a prompt, recorded with its queries, replayed into the cache of every mode compared.

Every KV mode prefills densely, so what a mode's cache receives while the prompt goes in is the same
whatever the mode: each layer's `update(K, V)` and then, from the attention function, `observe(queries)` on
a selective layer (H2O sums the attention of every prompt query, InfiniGen the query magnitudes, LeoAM and
the sparse path keep the last ones). A suite that asks many modes the same prompt can run the model over it
once, record both, and replay them into each mode's cache in the same order: the cache ends in the state
a real prefill leaves. The prompt's last `LIVE_TOKENS` tokens go through the model for real in every mode,
so the logits that start decoding come from that mode's own forward pass.

Unlike eval/sparse/prefill_tape.py (which replays updates only, for timing), the queries are replayed too:
an accuracy comparison must not starve a baseline of the prompt attention its design reads.
Memory: the recording holds the prompt's K/V and queries of every layer (fp32 smollm2-135m at 8K: ~0.9 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvtier.eval.accuracy.mass_recall import DenseAttentionProbe
from kvtier.generation import prefill
from kvtier.kv.model_geometry import text_config
from kvtier.kv.windowed import WindowedLayer

LIVE_TOKENS = 32  # the prompt's tail run through the model per mode (a selective cache needs > 1 token here)

Step = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, float]  # (layer, K, V, queries, scaling)


@dataclass
class RecordedPrompt:
    """What a dense prefill of ids[:, :recorded] handed each layer, chunk by chunk, in order."""

    ids: torch.Tensor  # [1, prompt tokens]
    chunk: int
    recorded: int
    steps: list[Step] = field(default_factory=list)

    def prefill(self, model, cache) -> torch.Tensor:
        """Replay the recorded updates and queries into `cache`, then run the rest of the prompt through `model`;
        the last position's logits [1, vocab]."""
        for layer_idx, keys, values, queries, scaling in self.steps:
            cache.update(keys, values, layer_idx)
            layer = cache.layers[layer_idx]
            if isinstance(layer, WindowedLayer):  # what the attention function shows a selective layer
                layer.observe(queries, scaling)
        return prefill(model, cache, self.ids[:, self.recorded :].to(model.device), self.chunk)


def record_prompt(model, ids: torch.Tensor, chunk: int = 1024, live: int = LIVE_TOKENS) -> RecordedPrompt:
    """Prefill ids [1, N] densely, `chunk` tokens per pass, recording all but the last `live` tokens."""
    recorded = max(ids.shape[1] - live, 0)
    if recorded % chunk == 1:
        recorded -= 1  # a one-token chunk after others would be taken for a decode step by a selective cache
    recording = RecordedPrompt(ids, chunk, recorded)
    if recorded:
        with torch.inference_mode(), _QueryRecorder(model, recording.steps):
            prefill(model, _RecordingCache(model, recording.steps), ids[:, :recorded].to(model.device), chunk)
    return recording


class _RecordingCache(DynamicCache):
    """A dense cache whose every update starts a recorded step (its queries are added by _QueryRecorder).

    A subclass, not a wrapper: the model takes only a Cache (eval/sparse/prefill_tape.py says why not a bound
    method either)."""

    def __init__(self, model, steps: list[Step]) -> None:
        super().__init__(config=text_config(model))
        self._steps = steps

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._steps.append((layer_idx, key_states.clone(), value_states.clone(), None, 0.0))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class _QueryRecorder(DenseAttentionProbe):
    """While entered, every attention call completes the step its layer's update opened with its queries."""

    def __init__(self, model, steps: list[Step]) -> None:
        super().__init__(model)
        self._steps = steps

    def _wrapped(self, inner_name: str):
        def attention(module, query, key, value, attention_mask, **kwargs):
            layer_idx, keys, values, _, _ = self._steps[-1]
            if layer_idx != module.layer_idx:
                raise RuntimeError(f"attention of layer {module.layer_idx} after the update of layer {layer_idx}")
            scaling = kwargs.get("scaling")
            scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
            self._steps[-1] = (layer_idx, keys, values, query.clone(), scaling)
            return ALL_ATTENTION_FUNCTIONS[inner_name](module, query, key, value, attention_mask, **kwargs)

        return attention
