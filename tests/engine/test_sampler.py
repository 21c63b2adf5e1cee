"""Token choice: argmax at temperature 0, seeded temperature / top-p sampling otherwise."""

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.engine.sampler import Sampler
from kvtier.engine.sequence import SamplingParams

GREEDY = SamplingParams()


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 2.0]])
    assert Sampler().choose(logits, [(0, GREEDY), (1, GREEDY)]) == [1, 0]


def test_top_p_keeps_only_the_smallest_set_reaching_the_mass():
    # probabilities ~0.665, 0.245, 0.090: top_p 0.6 leaves only the first token, whatever the seed
    logits = torch.log(torch.tensor([[0.665, 0.245, 0.090]]))
    narrow = SamplingParams(temperature=1.0, top_p=0.6)
    sampler = Sampler()
    assert {sampler.choose(logits, [(i, narrow)])[0] for i in range(50)} == {0}
    wide = SamplingParams(temperature=1.0, top_p=1.0)
    assert {sampler.choose(logits, [(100 + i, wide)])[0] for i in range(200)} == {0, 1, 2}


def test_a_seed_fixes_the_stream_and_a_request_keeps_its_generator_until_forgotten():
    logits = torch.zeros(1, 50)
    seeded = SamplingParams(temperature=1.0, seed=3)
    first, second = Sampler(), Sampler()
    stream = [first.choose(logits, [(0, seeded)])[0] for _ in range(10)]
    assert stream == [second.choose(logits, [(0, seeded)])[0] for _ in range(10)]
    assert len(set(stream)) > 1  # one generator drawn from repeatedly, not reseeded per token
    first.forget(0)
    assert first.choose(logits, [(0, seeded)])[0] == stream[0]


def test_mixed_batches_sample_only_the_sampled_rows():
    logits = torch.tensor([[0.0, 9.0], [0.0, 0.0]])
    tokens = Sampler().choose(logits, [(0, GREEDY), (1, SamplingParams(temperature=1.0, seed=0))])
    assert tokens[0] == 1 and tokens[1] in (0, 1)


@pytest.mark.parametrize("fields, message", [({"temperature": -0.5}, "temperature must be at least 0"),
                                             ({"top_p": 0}, "top_p must be in"), ({"top_p": 1.5}, "top_p must be in")])
def test_sampling_params_refuse_impossible_values(fields, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**fields)
