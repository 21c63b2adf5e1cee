"""Lookahead: the predicted query's mechanics and its settings (end to end: test_cache.py)."""

import numpy as np
import pytest
import torch
from transformers.models.llama import modeling_llama

import tiny_models
from kvtier.errors import ChecksumError, ConfigError
from kvtier.sparse.lookahead import Lookahead, QueryForecast
from kvtier.sparse.settings import SparseSettings


def _predicted_and_real(model, monkeypatch) -> tuple[list[torch.Tensor], torch.Tensor, bool]:
    """The last layer's query predicted from its own input (unsummed, summed), the real one [B, Hkv, G, D], and
    whether the summed prediction was the folded product."""
    queries = []
    rotate = modeling_llama.apply_rotary_pos_emb

    def recording(q, k, cos, sin, *args, **kwargs):
        rotated = rotate(q, k, cos, sin, *args, **kwargs)
        queries.append(rotated[0])
        return rotated

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", recording)
    kv_heads = model.config.num_key_value_heads
    forecasts = [QueryForecast(model, kv_heads, summed) for summed in (False, True)]
    try:
        with torch.inference_mode():
            model(input_ids=torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(11)))
            last = len(forecasts[0].decoders) - 1  # the hooks' last capture: the last layer's input
            predicted = [torch.from_numpy(forecast.score_query(last)) for forecast in forecasts]
            folded = forecasts[1]._folded(last) is not None
    finally:
        for forecast in forecasts:
            forecast.close()
    assert not any(decoder._forward_pre_hooks for decoder in forecasts[0].decoders)
    return predicted, queries[-1][:, :, -1].reshape(2, kv_heads, -1, queries[-1].shape[-1]), folded


def test_a_layer_predicted_from_its_own_input_gets_its_own_query(tiny_llama, monkeypatch):
    """The prediction is the layer's own projection, norm and rotation: fed the layer's real input, it must
    reproduce the layer's real query exactly (what differs in use is only the input, h_l for layer l+1)."""
    predicted, real, folded = _predicted_and_real(tiny_llama, monkeypatch)
    assert folded
    torch.testing.assert_close(predicted[0], real)
    torch.testing.assert_close(predicted[1], real.sum(dim=2, keepdim=True))


def test_the_summed_query_folds_the_norm_gain_and_the_query_bias(monkeypatch):
    model = tiny_models.tiny_llama(attention_bias=True)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for decoder in model.model.layers:
            decoder.input_layernorm.weight.copy_(torch.rand(64, generator=generator) + 0.5)
            decoder.self_attn.q_proj.bias.copy_(torch.randn(decoder.self_attn.q_proj.bias.shape, generator=generator))
    predicted, real, folded = _predicted_and_real(model, monkeypatch)
    assert folded  # the folded product answered, not the model's ops
    torch.testing.assert_close(predicted[1], real.sum(dim=2, keepdim=True))


class OnePlusWeightNorm(torch.nn.Module):
    """Gemma's RMSNorm form, scale 1 + weight, under Llama's attribute names: not what the fold assumes."""

    def __init__(self, norm) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, hidden):
        return (1 + self.weight) * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_a_norm_the_fold_does_not_reproduce_keeps_the_models_own_ops(monkeypatch):
    model = tiny_models.tiny_llama()
    for decoder in model.model.layers:
        decoder.input_layernorm = OnePlusWeightNorm(decoder.input_layernorm)
    predicted, real, folded = _predicted_and_real(model, monkeypatch)
    assert not folded
    torch.testing.assert_close(predicted[1], real.sum(dim=2, keepdim=True))


@pytest.mark.parametrize("settings", [{"candidate_margin": 0.5}, {"lookahead_skip": 0}, {"lookahead_min_cold": 0}])
def test_bad_lookahead_settings_are_refused(settings):
    with pytest.raises(ConfigError, match="lookahead"):
        SparseSettings(**settings).validated()


class _Scorer:
    """Takes candidates requests and answers them in order, with nothing."""

    def __init__(self) -> None:
        self.asked, self.answered = [], 0

    def request(self, tier: int, _query, _cold_tokens: int, _counts) -> None:
        self.asked.append(tier)

    def candidates(self):
        self.answered += 1
        return [], np.empty((1, 0, 0), dtype=np.uint8), np.zeros(1, dtype=np.int64)


def test_a_step_keeps_what_the_step_before_asked_for_it_and_drops_the_rest():
    scorer, query, counts = _Scorer(), np.zeros((1, 1, 1, 8), dtype=np.float32), np.array([16])
    lookahead = Lookahead(None, 1.5, 2, 1, scorer, None)
    for tier in (0, 1):  # the end of a step asks for the next step's first layers
        lookahead.start(tier, query, 100, counts, next_step=True)
    lookahead.open_step()
    assert lookahead.in_flight == (0, 1) and scorer.answered == 0
    lookahead.open_step()  # asked for the step before: that step ended midway
    assert lookahead.in_flight == () and scorer.answered == 2
    lookahead.start(5, query, 100, counts)  # a step that ended midway, with a layer's request still out
    lookahead.start(0, query, 100, counts, next_step=True)
    lookahead.open_step()
    assert lookahead.in_flight == () and scorer.answered == 4 and scorer.asked == [0, 1, 5, 0]


class _Forecast:
    def close(self) -> None:
        pass


class _DamagedScorer(_Scorer):
    """Its first answer fails its reads, as a damaged page does."""

    def candidates(self):
        if self.answered == 0:
            self.answered += 1
            raise ChecksumError("damaged page")
        return super().candidates()


def test_closing_finishes_every_request_in_flight_though_one_met_a_damaged_page():
    scorer, query, counts = _DamagedScorer(), np.zeros((1, 1, 1, 8), dtype=np.float32), np.array([16])
    lookahead = Lookahead(_Forecast(), 1.5, 2, 1, scorer, None)
    for tier in (0, 1):
        lookahead.start(tier, query, 100, counts, next_step=True)
    lookahead.close()  # the sequence is dropped for the damage: its dropped requests' failures are nobody's
    assert lookahead.in_flight == () and scorer.answered == 2  # the second request finished too
    damaged = _DamagedScorer()
    lookahead = Lookahead(_Forecast(), 1.5, 2, 1, damaged, None)
    lookahead.start(0, query, 100, counts)
    with pytest.raises(ChecksumError):  # mid-run, a step that drops it still meets the failure
        lookahead.drain()
