"""vLLM's sampling parameters through the real `openai` client (vLLM's extensions in `extra_body`), and n / best_of."""

import collections

import httpx
import pytest
from http_server import MODEL, moved, scrape

pytestmark = pytest.mark.model

COUNTING = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"  # the next token is a repeat of the prompt's
# Every vLLM sampling field at the value that changes nothing, as load generators send them.
NO_OPS = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "stop_token_ids": [],
          "ignore_eos": False, "logit_bias": {}}


def complete(client, prompt=COUNTING, **fields):
    extra = {name: fields.pop(name) for name in list(fields) if name in NO_OPS or name == "top_k"}
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=fields.pop("max_tokens", 6),
                                     extra_body=extra, **fields)


def test_vllm_fields_at_their_defaults_change_nothing_on_either_endpoint(client):
    greedy = complete(client, temperature=0)
    assert complete(client, temperature=0, presence_penalty=0, frequency_penalty=0, **NO_OPS).choices[0].text \
        == greedy.choices[0].text
    messages = [{"role": "user", "content": "Count: 1, 2, 3"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    extended = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                              presence_penalty=0, frequency_penalty=0, extra_body=NO_OPS)
    assert extended.choices[0].message.content == plain.choices[0].message.content


def test_repetition_penalty_lowers_a_repeated_tokens_probability(client, reference_llm):
    tokenizer = reference_llm.tokenizer
    prompt_ids = set(tokenizer(COUNTING)["input_ids"])
    free = complete(client, temperature=0, max_tokens=1, logprobs=1)
    repeated = free.choices[0].logprobs.tokens[0]
    assert tokenizer.convert_tokens_to_ids(tokenizer.tokenize(repeated))[0] in prompt_ids  # greedy repeats

    def first_tokens(**fields) -> collections.Counter:
        reply = complete(client, temperature=1.0, max_tokens=1, n=32, seed=3, **fields)
        return collections.Counter(choice.text for choice in reply.choices)

    assert complete(client, temperature=0, max_tokens=1, repetition_penalty=1.8).choices[0].text != repeated
    drawn, penalized = first_tokens(), first_tokens(repetition_penalty=1.8)
    assert penalized[repeated] < drawn[repeated]  # drawn less often: its probability fell


def test_top_k_1_is_greedy_at_any_temperature_on_both_endpoints(client):
    assert complete(client, temperature=1.5, top_k=1, seed=1).choices[0].text \
        == complete(client, temperature=0).choices[0].text
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **fields,
                                           ).choices[0].message.content
            for fields in ({"temperature": 0}, {"temperature": 1.5, "seed": 2, "extra_body": {"top_k": 1}})]
    assert chat[0] == chat[1]


def test_min_p_and_top_k_narrow_what_is_drawn(client):
    wide = {choice.text for choice in complete(client, temperature=2.0, max_tokens=1, n=24, seed=5).choices}
    narrow = {choice.text for choice in complete(client, temperature=2.0, max_tokens=1, n=24, seed=5,
                                                 top_k=2).choices}
    thin = {choice.text for choice in complete(client, temperature=2.0, max_tokens=1, n=24, seed=5,
                                               min_p=0.5).choices}
    assert len(narrow) <= 2 < len(wide) and len(thin) < len(wide)


def test_presence_frequency_and_logit_bias_move_the_choice(client, reference_llm):
    tokenizer = reference_llm.tokenizer
    free = complete(client, temperature=0, max_tokens=8)
    target = tokenizer(" banana")["input_ids"][0]
    biased = complete(client, temperature=0, max_tokens=3, logit_bias={str(target): 100})
    assert biased.choices[0].text == tokenizer.decode([target] * 3)
    penalized = complete(client, temperature=0, max_tokens=8, presence_penalty=2.0, frequency_penalty=2.0)
    assert penalized.choices[0].text != free.choices[0].text


def test_stop_token_ids_and_min_tokens(client, reference_llm):
    prompt = reference_llm.tokenizer(COUNTING, return_tensors="pt")["input_ids"]
    greedy = reference_llm.model.generate(prompt, max_new_tokens=8, do_sample=False)[0, prompt.shape[1]:].tolist()
    stopped = complete(client, temperature=0, max_tokens=8, stop_token_ids=[greedy[2]])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == greedy.index(greedy[2]) + 1
    assert stopped.choices[0].text == reference_llm.tokenizer.decode(greedy[:stopped.usage.completion_tokens])
    messages = [{"role": "user", "content": "What is the capital of France? One word."}]
    short = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 12
    held = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                          extra_body={"min_tokens": 12})
    assert held.usage.completion_tokens >= 12


def test_n_choices_with_a_seed_are_the_seeded_requests_seed_and_seed_plus_one(client, paged_server):
    url = paged_server[0].url
    before = scrape(url)
    pair = complete(client, temperature=1.0, n=2, seed=11, max_tokens=10)
    assert moved(before, scrape(url), "kvtier:requests_total", path="paged") == 1  # one request, two sequences
    assert [choice.index for choice in pair.choices] == [0, 1]
    alone = [complete(client, temperature=1.0, seed=seed, max_tokens=10).choices[0].text for seed in (11, 12)]
    assert [choice.text for choice in pair.choices] == alone and alone[0] != alone[1]
    assert pair.usage.completion_tokens == 20
    chunks = list(complete(client, temperature=1.0, n=2, seed=11, max_tokens=10, stream=True))
    texts = {index: "".join(chunk.choices[0].text for chunk in chunks if chunk.choices[0].index == index)
             for index in (0, 1)}
    assert [texts[0], texts[1]] == alone
    assert sorted(chunk.choices[0].index for chunk in chunks if chunk.choices[0].finish_reason) == [0, 1]


def test_best_of_returns_the_choices_with_the_highest_cumulative_logprob(client):
    candidates = [complete(client, temperature=1.0, seed=seed, max_tokens=5, logprobs=0).choices[0]
                  for seed in (21, 22, 23)]
    best = max(candidates, key=lambda choice: sum(choice.logprobs.token_logprobs))
    reply = complete(client, temperature=1.0, seed=21, max_tokens=5, n=1, best_of=3)
    assert [choice.text for choice in reply.choices] == [best.text] and reply.choices[0].index == 0
    assert reply.usage.completion_tokens == 15  # every candidate was generated


@pytest.mark.parametrize("fields, param", [
    ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -9}, "frequency_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"10000000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"stop_token_ids": [10 ** 7]}, "stop_token_ids"),
    ({"min_tokens": 50, "max_tokens": 5}, "min_tokens"), ({"n": 0}, "n"), ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"logprobs": 21}, "logprobs"),
])
def test_a_bad_sampling_value_is_a_400_naming_its_field(paged_server, fields, param):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2} | fields
    response = httpx.post(paged_server[0].url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "\n" not in error["message"]
