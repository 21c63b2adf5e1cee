"""Token choice on logit rows: argmax, vLLM's logits processors and sampling parameters, log-probabilities."""

import math

import pytest
import torch

from kvtier.engine.sampler import Sampler
from kvtier.engine.sampling_params import SamplingError
from kvtier.engine.sequence import SamplingParams, Sequence

GREEDY = SamplingParams()


def seq(sampling: SamplingParams = GREEDY, request_id: int = 0, prompt=(0,), output=()) -> Sequence:
    return Sequence(request_id, list(prompt), sampling, output_ids=list(output))


def choose(logits, *seqs, sampler=None) -> list[int]:
    return (sampler or Sampler()).choose(torch.as_tensor(logits, dtype=torch.float32), list(seqs)).tokens


def test_greedy_rows_take_the_argmax():
    assert choose([[0.0, 3.0, 1.0], [5.0, 1.0, 2.0]], seq(), seq(request_id=1)) == [1, 0]


def test_a_greedy_row_is_the_plain_argmax_whatever_its_batch_mates_ask_for():
    logits = torch.tensor([[1.0, 2.0, 0.5, 1.9]] * 3)
    mates = [seq(SamplingParams(repetition_penalty=2.0), 1, prompt=[1]),
             seq(SamplingParams(temperature=1.0, top_k=2, min_p=0.1, logit_bias={3: 5.0}, seed=1), 2)]
    assert choose(logits, seq(), *mates)[0] == 1
    assert choose(logits, *mates, seq())[2] == 1


def test_repetition_penalty_divides_a_seen_positive_logit_and_multiplies_a_seen_negative_one():
    # token 1 (2.0) is in the prompt: 2.0 / 2 = 1.0 < token 3 (1.9); token 2 (-1.0) in the output: -2.0
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.9]])
    penalized = seq(SamplingParams(repetition_penalty=2.0), prompt=[1], output=[2])
    assert choose(logits, seq()) == [1]
    assert choose(logits, penalized) == [3]
    sampler = Sampler()
    processed = logits.clone()
    sampler._process(processed, [penalized])
    assert processed[0].tolist() == pytest.approx([0.0, 1.0, -2.0, 1.9])


def test_presence_and_frequency_penalties_count_only_the_output():
    logits = torch.zeros(1, 4)
    sampling = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    Sampler()._process(logits, [seq(sampling, prompt=[3, 3], output=[1, 1, 2])])
    assert logits.tolist() == [[0.0, -(0.5 + 2 * 0.25), -(0.5 + 0.25), 0.0]]


def test_top_k_1_is_greedy_at_any_temperature():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    rows = [seq(SamplingParams(temperature=1.5, top_k=1), request_id=i) for i in range(8)]
    assert choose(logits, *rows) == logits.argmax(dim=-1).tolist()


def test_top_p_keeps_only_the_smallest_set_reaching_the_mass():
    # probabilities ~0.665, 0.245, 0.090: top_p 0.6 leaves only the first token, whatever the draw
    logits = torch.log(torch.tensor([[0.665, 0.245, 0.090]]))
    narrow = SamplingParams(temperature=1.0, top_p=0.6)
    sampler = Sampler()
    assert {choose(logits, seq(narrow, i), sampler=sampler)[0] for i in range(50)} == {0}
    wide = SamplingParams(temperature=1.0, top_p=1.0)
    assert {choose(logits, seq(wide, 100 + i), sampler=sampler)[0] for i in range(200)} == {0, 1, 2}


def test_top_k_and_min_p_drop_the_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler()
    top_two = {choose(logits, seq(SamplingParams(temperature=1.0, top_k=2), i), sampler=sampler)[0] for i in range(200)}
    above_a_quarter = {choose(logits, seq(SamplingParams(temperature=1.0, min_p=0.25), i), sampler=sampler)[0]
                       for i in range(200)}
    assert top_two == {0, 1} and above_a_quarter == {0, 1, 2}  # 0.15 >= 0.25 x 0.5; 0.05 is not


def test_min_tokens_holds_back_end_of_sequence_and_stop_tokens():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])  # 1 is end-of-sequence, 2 a stop token
    sampling = SamplingParams(min_tokens=2, stop_token_ids=(2,))
    sampler = Sampler(eos_token_ids=(1,))
    assert choose(logits, seq(sampling, output=[3]), sampler=sampler) == [3]
    assert choose(logits, seq(sampling, output=[3, 3]), sampler=sampler) == [1]
    ignoring = SamplingParams(min_tokens=2, ignore_eos=True)
    assert choose(logits, seq(ignoring), sampler=sampler) == [1]  # end-of-sequence does not stop it anyway


def test_logit_bias_adds_to_the_named_tokens():
    logits = torch.tensor([[0.0, 1.0, 0.5]])
    assert choose(logits, seq(SamplingParams(logit_bias={2: 1.0}))) == [2]
    assert choose(logits, seq(SamplingParams(logit_bias={1: -100.0}))) == [2]


def test_logprobs_are_the_raw_log_softmax_whatever_the_sampling():
    torch.manual_seed(1)
    logits = torch.randn(2, 30)
    asked = SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.3, logprobs=3, seed=2)
    sampled = Sampler().choose(logits.clone(), [seq(asked, prompt=[4, 5]), seq(request_id=1)])
    expected = torch.log_softmax(logits[0], dim=-1)
    entry = sampled.logprobs[0]
    assert entry.token_id == sampled.tokens[0]
    assert entry.logprob == pytest.approx(float(expected[entry.token_id]), abs=1e-6)
    assert [token for token, _ in entry.top] == expected.topk(3).indices.tolist()
    assert [value for _, value in entry.top] == pytest.approx(expected.topk(3).values.tolist(), abs=1e-6)
    assert sampled.logprobs[1] is None  # not asked for


def test_a_seed_fixes_the_stream_and_a_sequence_keeps_its_generator_until_forgotten():
    logits = torch.zeros(1, 50)
    seeded = seq(SamplingParams(temperature=1.0, seed=3))
    first, second = Sampler(), Sampler()
    stream = [choose(logits, seeded, sampler=first)[0] for _ in range(10)]
    assert stream == [choose(logits, seeded, sampler=second)[0] for _ in range(10)]
    assert len(set(stream)) > 1  # one generator drawn from repeatedly, not reseeded per token
    first.forget(0)
    assert choose(logits, seeded, sampler=first)[0] == stream[0]


def test_a_seeded_rows_draws_do_not_depend_on_its_batch_mates():
    torch.manual_seed(2)
    logits = torch.randn(3, 40)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    alone = [choose(logits[:1], seq(seeded), sampler=Sampler())[0] for _ in range(1)]
    mates = [seq(SamplingParams(temperature=0.5, top_k=3), 1), seq(SamplingParams(temperature=1.0), 2)]
    together = choose(logits, seq(seeded), *mates, sampler=Sampler())
    assert together[0] == alone[0]


def test_mixed_batches_sample_only_the_sampled_rows():
    logits = torch.tensor([[0.0, 9.0], [0.0, 0.0]])
    tokens = choose(logits, seq(), seq(SamplingParams(temperature=1.0, seed=0), 1))
    assert tokens[0] == 1 and tokens[1] in (0, 1)


@pytest.mark.parametrize("fields, name", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_tokens": 100}, "min_tokens"), ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ({"logit_bias": {3: 101.0}}, "logit_bias"), ({"logprobs": 21}, "logprobs"), ({"n": 0}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"), ({"temperature": math.nan}, "temperature"), ({"seed": 1.5}, "seed"),
])
def test_sampling_params_refuse_impossible_values_naming_the_field(fields, name):
    with pytest.raises(SamplingError, match=f"^{name} ") as error:
        SamplingParams(**fields)
    assert error.value.field == name and "\n" not in str(error.value)


@pytest.mark.parametrize("candidates", [1, 2, 3])
def test_a_top_p_set_is_the_same_found_among_candidates_or_by_sorting_everything(candidates):
    from kvtier.engine.logits_processors import draw

    # probabilities ~0.665, 0.245, 0.090: top_p 0.8 keeps the first two (one candidate holds too little mass)
    logits = torch.log(torch.tensor([[0.665, 0.245, 0.090]])).expand(400, 3).clone()
    uniforms = torch.linspace(0, 0.999, 400)
    tokens = draw(logits, torch.zeros(400), torch.full((400,), 0.8), uniforms, candidates=candidates)
    assert set(tokens.tolist()) == {0, 1}
    assert (tokens == 0).float().mean().item() == pytest.approx(0.665 / 0.91, abs=0.01)
