"""Log-probabilities in OpenAI's shapes, streamed and whole, against the model's log-softmax computed directly."""

import pytest
import torch
from http_server import MODEL

pytestmark = pytest.mark.model

PROMPT = "The lighthouse keeper counted the ships:"
TOLERANCE = 1e-4


def reference(llm, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of `ids`, computed directly."""
    with torch.no_grad():
        return torch.log_softmax(llm.model(torch.tensor([ids])).logits[0].float(), dim=-1)


def greedy_ids(llm, prompt_ids: list[int], count: int) -> list[int]:
    out = llm.model.generate(torch.tensor([prompt_ids]), max_new_tokens=count, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def check(llm, ids: list[int], generated: list[int], tokens: list[str], logprobs: list[float],
          alternatives: list[list[tuple[str, float]]], first: int) -> None:
    """Position `first + i` of `ids + generated` produced token i: its text, log-probability and alternatives."""
    expected = reference(llm, ids + generated)
    decode = llm.tokenizer.decode
    assert tokens == [decode([token]) for token in generated]
    for i, token in enumerate(generated):
        row = expected[first + i - 1]
        assert logprobs[i] == pytest.approx(float(row[token]), abs=TOLERANCE)
        top = row.topk(len(alternatives[i]))
        assert [text for text, _ in alternatives[i]] == [decode([t]) for t in top.indices.tolist()]
        assert [value for _, value in alternatives[i]] == pytest.approx(top.values.tolist(), abs=TOLERANCE)


def test_completion_logprobs_whole_and_streamed_match_the_models_log_softmax(client, reference_llm):
    ids = reference_llm.tokenizer(PROMPT)["input_ids"]
    generated = greedy_ids(reference_llm, ids, 6)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    body = reply.choices[0].logprobs
    alternatives = [sorted(top.items(), key=lambda pair: -pair[1])[:2] for top in body.top_logprobs]
    check(reference_llm, ids, generated, body.tokens, body.token_logprobs, alternatives, len(ids))
    assert body.text_offset == [sum(len(t) for t in body.tokens[:i]) for i in range(6)]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                            stream=True))
    streamed = [token for chunk in chunks if chunk.choices[0].logprobs
                for token in chunk.choices[0].logprobs.tokens]
    offsets = [offset for chunk in chunks if chunk.choices[0].logprobs
               for offset in chunk.choices[0].logprobs.text_offset]
    assert streamed == body.tokens and offsets == body.text_offset
    assert "".join(chunk.choices[0].text for chunk in chunks) == reply.choices[0].text


def test_chat_logprobs_whole_and_streamed_match_the_models_log_softmax(client, reference_llm):
    messages = [{"role": "user", "content": "Name a large city."}]
    ids = reference_llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    generated = greedy_ids(reference_llm, ids, 5)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    check(reference_llm, ids, generated, [entry.token for entry in content], [entry.logprob for entry in content],
          [[(alt.token, alt.logprob) for alt in entry.top_logprobs] for entry in content], len(ids))
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert streamed == content
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == reply.choices[0].message.content


def test_logprobs_of_a_sampled_token_are_of_the_raw_distribution(client, reference_llm):
    ids = reference_llm.tokenizer(PROMPT)["input_ids"]
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=1.7, seed=4,
                                      logprobs=0, extra_body={"top_k": 5, "repetition_penalty": 1.5})
    body = reply.choices[0].logprobs
    row = reference(reference_llm, ids)[-1]
    [token] = [t for t in row.topk(5).indices.tolist() if reference_llm.tokenizer.decode([t]) == body.tokens[0]]
    assert body.token_logprobs[0] == pytest.approx(float(row[token]), abs=TOLERANCE)  # no temperature, no penalty
    assert list(body.top_logprobs[0]) == [body.tokens[0]]  # logprobs 0: the token alone


def test_echo_prepends_the_prompt_and_its_logprobs_first_null(client, reference_llm):
    ids = reference_llm.tokenizer(PROMPT)["input_ids"]
    generated = greedy_ids(reference_llm, ids, 3)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                      logprobs=1)
    choice = reply.choices[0]
    assert choice.text == PROMPT + reference_llm.tokenizer.decode(generated)
    body = choice.logprobs
    assert body.tokens[0] == reference_llm.tokenizer.decode([ids[0]])
    assert body.token_logprobs[0] is None and body.top_logprobs[0] is None
    everything = ids + generated
    expected = reference(reference_llm, everything)
    for position in range(1, len(everything)):
        assert body.token_logprobs[position] == pytest.approx(float(expected[position - 1, everything[position]]),
                                                              abs=TOLERANCE)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                              stream=True))
    assert "".join(chunk.choices[0].text for chunk in streamed) == choice.text
