"""`--kv infinigen`: the paper's "Prefetch-based" baseline (InfiniGen, Lee et al., OSDI'24).

InfiniGen speculates which tokens layer l will attend while layer l-1 still
runs: the attention input of layer l-1 is close to layer l's, so multiplying it
with a *partial* query weight of layer l and a *partial key cache* (a few
channels per head) approximates layer l's attention scores. The top tokens'
full K/V are then prefetched from host memory (here also from disk) and layer
l attends exactly over them.

Here:
- A forward pre-hook on decoder layer l-1 (removed by `cache.close()`) takes its
  input hidden states, applies layer l's own input norm, query projection (and
  query norm, Gemma 3) and rotary embedding at the new token's position, and
  keeps the partial channels. The disk pages holding the chosen tokens (K and V) are
  submitted to the I/O engine right away, so the reads overlap layer l-1's
  attention and MLP; layers alternate between two staging buffers so layer l's
  reads never overwrite what layer l-1 has not gathered yet. A tiered layer 0
  has no predecessor: it scores with its own query, reading synchronously.
- Partial channels: InfiniGen skews Q/K with an offline SVD of the weights so
  that few channels carry most of q.k. With rotary embeddings the rotation sits
  between the weights and the scores, so the practical equivalent used here is
  a post-RoPE channel selection: per KV head the `partial_ratio` share (30%,
  InfiniGen's partial weight ratio) of head-dim channels with the largest
  sum|q| x sum|k| over the prompt (queries seen at prefill, prompt keys).
- The partial key cache (those channels of every pool token's key) is in host
  DRAM and counted against the host budget. The full query is projected and
  then sliced (InfiniGen multiplies by the partial weight only): one extra query
  projection per layer, negligible next to the I/O and charged to InfiniGen.
- Selection is per token, not per head with a threshold: approximate softmax
  scores summed over query heads, top-alpha share of the pool, so every mode
  attends the same number of tokens per step.
"""

from __future__ import annotations

import inspect
import math
import sys
from concurrent.futures import Future

import numpy as np
import torch

from kvtier.baselines.selective_runtime import SelectiveRuntime, TierSetup
from kvtier.baselines.selective import Selected, SelectiveCache, SelectiveLayer, build_cache, grouped_query
from kvtier.kv.model_geometry import model_geometry
from kvtier.storage import K, V

PARTIAL_RATIO = 0.3


def choose_channels(query_magnitude: torch.Tensor, key_magnitude: torch.Tensor, count: int) -> torch.Tensor:
    """Per KV head the `count` channels with the largest |q| x |k| ([H, D] each), ascending: long [H, count]."""
    return (query_magnitude * key_magnitude).topk(count, dim=1).indices.sort(dim=1).values


def take_channels(tensor: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """tensor [B, H, N, D] (keys, or a grouped query) restricted to each head's channels [H, c]: [B, H, N, c]."""
    batch, heads, tokens, _ = tensor.shape
    return tensor.gather(3, channels[None, :, None, :].expand(batch, heads, tokens, -1).to(tensor.device))


def approximate_scores(partial_query: torch.Tensor, partial_keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Token importance [B, N]: softmax of partial query [B, H, G, c] x partial keys [B, H, N, c], summed over heads."""
    logits = torch.matmul(partial_query, partial_keys.float().transpose(2, 3)) * scaling
    return logits.softmax(dim=-1).sum(dim=(1, 2))


def speculative_query(model, layer_idx: int, hidden: torch.Tensor, position: int) -> torch.Tensor:
    """Layer `layer_idx`'s post-RoPE query [B, Hq, 1, D] computed from another layer's input `hidden` [B, 1, hidden]."""
    decoder = model.model.layers[layer_idx]
    attention = decoder.self_attn
    normed = decoder.input_layernorm(hidden)
    query = attention.q_proj(normed).view(hidden.shape[0], 1, -1, attention.head_dim).transpose(1, 2)
    if getattr(attention, "q_norm", None) is not None:
        query = attention.q_norm(query)
    position_ids = torch.full((hidden.shape[0], 1), position, device=hidden.device)
    rotary = model.model.rotary_emb
    if "layer_type" in inspect.signature(rotary.forward).parameters:  # Gemma 3: one rotary per layer type
        cos, sin = rotary(normed, position_ids, model.config.get_text_config(decoder=True).layer_types[layer_idx])
    else:
        cos, sin = rotary(normed, position_ids)
    rotated, _ = sys.modules[type(attention).__module__].apply_rotary_pos_emb(query, query, cos, sin)
    return rotated


class InfiniGenLayer(SelectiveLayer):
    """A tiered layer whose tokens are chosen from a partial key cache before it runs, and prefetched."""

    def __init__(self, layer_idx: int, runtime: SelectiveRuntime, channels: int, buffer: int) -> None:
        super().__init__(layer_idx, runtime)
        self.channels = channels
        self.buffer = buffer  # staging buffer of this layer's reads (alternates between tiered layers)
        self.channel_index: torch.Tensor | None = None
        self.partial_keys: torch.Tensor | None = None
        self._query_magnitude: torch.Tensor | None = None
        self.speculated: tuple[np.ndarray, Future] | None = None  # this step's pool indices and their reads

    def observe(self, query: torch.Tensor, scaling: float) -> None:
        magnitude = query.detach().float().abs().sum(dim=(0, 2)).cpu()  # [Hq, D]
        self._query_magnitude = magnitude if self._query_magnitude is None else self._query_magnitude + magnitude

    def prepare(self, pool_keys: torch.Tensor) -> None:
        """Choose the partial channels from the prompt and allocate the partial key cache."""
        batch, heads, _, head_dim = self.keys.shape
        key_magnitude = self.keys.float().abs().sum(dim=(0, 2)).cpu()
        query_magnitude = torch.ones_like(key_magnitude)
        if self._query_magnitude is not None:
            query_magnitude = self._query_magnitude.reshape(heads, -1, head_dim).sum(dim=1)
        self.channel_index = choose_channels(query_magnitude, key_magnitude, self.channels)
        self.partial_keys = torch.empty(batch, heads, self.runtime.setup.max_tokens, self.channels, dtype=self.dtype)

    def on_admit(self, keys: torch.Tensor, first: int) -> None:
        self.partial_keys[:, :, first : first + keys.shape[2]] = take_channels(keys, self.channel_index)

    def speculate(self, query: torch.Tensor, scaling: float) -> None:
        """Choose this step's tokens from the (speculative) query [B, Hq, 1, D] and submit their disk reads."""
        self.distribute()
        partial_query = take_channels(grouped_query(query, self.channel_index.shape[0]), self.channel_index)
        scores = approximate_scores(partial_query, self.partial_keys[:, :, : self.pooled_tokens], scaling)
        index = scores.topk(self.selection_size(), dim=1).indices.sort(dim=1).values.numpy()
        future = self.runtime.kv.submit_tokens(self.layer_idx, index, (K, V), self.buffer)
        self.speculated = (index, future)

    def select(self, query: torch.Tensor, scaling: float) -> Selected:
        if self.speculated is None:  # no layer before this one: speculate with the real query
            self.speculate(query, scaling)
        index, future = self.speculated
        self.speculated = None
        future.result()
        return Selected(index, self.gather(index, K, self.buffer), self.gather(index, V, self.buffer))


def _speculation_hook(model, layer: InfiniGenLayer):
    """Forward pre-hook for the decoder layer before `layer`: speculate `layer`'s selection at decode steps."""
    scaling = model.model.layers[layer.layer_idx].self_attn.scaling

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] == 1 and layer.tokens:
            layer.speculate(speculative_query(model, layer.layer_idx, hidden, layer.tokens), scaling)

    return hook


def make_infinigen_cache(model, setup: TierSetup, partial_ratio: float = PARTIAL_RATIO) -> SelectiveCache:
    """The `--kv infinigen` cache; the partial key cache is charged to the host budget."""
    geometry = model_geometry(model, setup.tiered_layers)
    channels = max(1, math.ceil(partial_ratio * geometry.head_dim))
    partial_bytes = (geometry.num_layers * setup.batch_size * setup.max_tokens * geometry.num_kv_heads * channels
                     * geometry.itemsize)

    def make_layer(layer_idx: int, runtime: SelectiveRuntime) -> InfiniGenLayer:
        return InfiniGenLayer(layer_idx, runtime, channels, setup.tiered_layers.index(layer_idx) % 2)

    reserved_for = f"InfiniGen's partial key cache of {channels}/{geometry.head_dim} channels per head"
    cache = build_cache(model, setup, make_layer, partial_bytes, reserved_for, buffers=2)
    decoder_layers = model.model.layers
    for layer in cache.runtime.layers:
        if layer.layer_idx:
            hook = decoder_layers[layer.layer_idx - 1].register_forward_pre_hook(_speculation_hook(model, layer),
                                                                               with_kwargs=True)
            cache.runtime.hooks.append(hook)
    return cache
