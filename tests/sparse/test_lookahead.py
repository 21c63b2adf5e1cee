"""Lookahead: the predicted query's mechanics and its settings (end to end: test_cache.py)."""

import pytest
import torch
from transformers.models.llama import modeling_llama

from kvtier.errors import ConfigError
from kvtier.sparse.lookahead import QueryForecast
from kvtier.sparse.settings import SparseSettings


def test_a_layer_predicted_from_its_own_input_gets_its_own_query(tiny_llama, monkeypatch):
    """The prediction is the layer's own projection, norm and rotation: fed the layer's real input, it must
    reproduce the layer's real query exactly (what differs in use is only the input, h_l for layer l+1)."""
    queries = []
    rotate = modeling_llama.apply_rotary_pos_emb

    def recording(q, k, cos, sin, *args, **kwargs):
        rotated = rotate(q, k, cos, sin, *args, **kwargs)
        queries.append(rotated[0])
        return rotated

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", recording)
    config = tiny_llama.config
    kv_heads = config.num_key_value_heads
    forecasts = [QueryForecast(tiny_llama, kv_heads, summed) for summed in (False, True)]
    try:
        with torch.inference_mode():
            tiny_llama(input_ids=torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(11)))
            last = len(forecasts[0].decoders) - 1  # the hooks' last capture: the last layer's input
            predicted = [forecast.score_query(last) for forecast in forecasts]
    finally:
        for forecast in forecasts:
            forecast.close()
    assert not any(decoder._forward_pre_hooks for decoder in forecasts[0].decoders)
    real = queries[-1][:, :, -1].reshape(2, kv_heads, -1, queries[-1].shape[-1])  # [B, Hkv, G, D]
    torch.testing.assert_close(predicted[0], real)
    torch.testing.assert_close(predicted[1], real.sum(dim=2, keepdim=True))


@pytest.mark.parametrize("settings", [{"lookahead_margin": 0.5}, {"lookahead_skip": 0}, {"lookahead_min_cold": 0}])
def test_bad_lookahead_settings_are_refused(settings):
    with pytest.raises(ConfigError, match="lookahead"):
        SparseSettings(**settings).validated()
