"""The endpoints through the real `openai` client (and raw httpx for what a client library cannot send)."""

import asyncio
import json
import os
import signal
from pathlib import Path

import httpx
import openai
import pytest
from http_server import MODEL, moved, running_server, scrape, settled

from kvtier.engine.serving_engine import EngineConfig, LLMEngine
from kvtier.engine.sequence import SamplingParams

pytestmark = pytest.mark.model

KEY = "test-key"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(llm, tmp_path_factory):
    # 24 blocks of 16 tokens: short prompts are paged, a ~500-token one is tiered; a tiered sequence yields its share
    # to a waiting one after 8 tokens.
    with running_server(llm, tmp_path_factory.mktemp("app"), api_key=KEY, sparse=True, device_blocks=24,
                        swap="flash", swap_space="16MiB", tiered_slice=8) as (thread, backend):
        yield thread, backend


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def raw(server):
    with httpx.Client(base_url=server[0].url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as http:
        yield http


def engine_reference(llm, prompt: str, max_tokens: int):
    """What the serving engine (as `kvtier batch` runs it) generates greedily for one user turn."""
    with LLMEngine.from_llm(llm, EngineConfig(block_tokens=16, device_blocks=64, swap="recompute")) as engine:
        return engine.generate([prompt], SamplingParams(max_new_tokens=max_tokens))[0]


def test_chat_completion_is_the_engines_greedy_answer_with_usage(client, reference_llm):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=12, temperature=0)
    choice, expected = reply.choices[0], engine_reference(reference_llm, QUESTION, 12)
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert "Paris" in choice.message.content
    assert choice.finish_reason == expected.finish_reason
    turn = [{"role": "user", "content": QUESTION}]
    prompt_tokens = len(reference_llm.tokenizer.apply_chat_template(turn, add_generation_prompt=True,
                                                                    return_dict=False))
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_completion_continues_raw_text_and_counts_tokens(client, reference_llm):
    prompt = "The capital of France is"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    ids = reference_llm.tokenizer(prompt, return_tensors="pt")["input_ids"]
    expected = reference_llm.model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    assert reply.choices[0].text == reference_llm.tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (ids.shape[1], 6)
    assert reply.model == MODEL and reply.object == "text_completion"


def test_streaming_chat_sends_deltas_then_finish_then_usage_then_done(client, raw):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    finishing = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert len(finishing) == 1 and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=10, temperature=0)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage
    body = {"model": MODEL, "prompt": "One, two,", "max_tokens": 4, "temperature": 0, "stream": True}
    lines = [line for line in raw.post("/v1/completions", json=body).text.splitlines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert all("usage" not in json.loads(line.removeprefix("data: ")) for line in lines[:-1])  # not asked for


def test_stop_strings_cut_the_text_and_end_generation(client):
    free = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    assert " 6," in free.choices[0].text
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                        stop=[" 6"])
    assert stopped.choices[0].text == free.choices[0].text.split(" 6")[0]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < free.usage.completion_tokens
    chunks = list(client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                            stop=[" 6"], stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == stopped.choices[0].text  # " 6" never shown
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices[0].finish_reason] == ["stop"]


def test_seeded_sampling_repeats_and_temperature_zero_is_greedy(client):
    def ask(**sampling):
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                         **sampling).choices[0].text

    assert ask(temperature=1.2, top_p=0.95, seed=11) == ask(temperature=1.2, top_p=0.95, seed=11)
    assert ask(temperature=0) == ask(temperature=0, seed=5)
    assert len({ask(temperature=1.5, seed=seed) for seed in range(4)}) > 1


def test_a_prompt_beyond_the_device_pool_is_a_tiered_sequence_reusing_the_stored_document(
        client, server, reference_llm):
    url = server[0].url
    prompt = "The quick brown fox jumps over the lazy dog. " * 50  # ~500 tokens, the pool holds 384
    before = scrape(url, KEY)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    ids = reference_llm.tokenizer(prompt, return_tensors="pt")["input_ids"]
    expected = reference_llm.model.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1]:].tolist()
    assert reply.usage.prompt_tokens == ids.shape[1] > 24 * 16
    assert reply.choices[0].text == reference_llm.tokenizer.decode(expected, skip_special_tokens=True)
    first = scrape(url, KEY)
    assert moved(before, first, "kvtier:tiered_requests_total") == 1
    assert moved(before, first, "kvtier:tiered_cold_read_bytes_total") > 0  # its KV went through the disk tier
    assert moved(before, first, "kvtier:tiered_reused_prompt_tokens_total") == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    second = scrape(url, KEY)
    assert again.choices[0].text == reply.choices[0].text
    assert moved(first, second, "kvtier:tiered_reused_prompt_tokens_total") > 0  # the first request stored it
    assert moved(first, second, "kvtier:tiered_kv_store_read_bytes_total") > 0


def test_eight_concurrent_tiered_requests_each_find_their_planted_fact(server):
    """Alpha 0.2 (the default): each tiered sequence attends a fifth of its pooled tokens, yet finds its needle,
    while the others decode in the same forwards (four at a time, the rest waiting for a host share, which the
    running ones yield after 8 tokens: set aside on flash and brought back)."""
    from kvtier.data.corpus import generate_text
    from kvtier.data.needle import build_haystack, make_needles, score_answer

    tokenizer = server[1].llm.tokenizer
    prompts = []
    for seed in range(8):
        [needle] = make_needles(1, seed=100 + seed)
        haystack = build_haystack(tokenizer, generate_text(6000, seed=seed), 500, [needle], [0.5])
        prompts.append((haystack.prompt, needle.value))
    client = openai.AsyncOpenAI(base_url=server[0].url + "/v1", api_key=KEY, max_retries=0)

    async def ask(prompt: str):
        return await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=24, temperature=0)

    async def ask_all():
        return await asyncio.gather(*(ask(prompt) for prompt, _ in prompts))

    before = scrape(server[0].url, KEY)
    replies = asyncio.run(ask_all())
    after = scrape(server[0].url, KEY)
    assert moved(before, after, "kvtier:requests_total", path="tiered") == 8
    assert moved(before, after, "kvtier:tiered_set_asides_total") >= 4
    assert moved(before, after, "kvtier:tiered_set_aside_bytes_total") > 0
    answers = [reply.choices[0].message.content for reply in replies]
    assert [score_answer(answer, value) for answer, (_, value) in zip(answers, prompts)] == [True] * 8, answers


def scorer_processes() -> list[int]:
    """Pids of the storage scorer processes this process started (one per tiered request being served)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and b"kvtier.sparse.scorer.process" in command:
            pids.append(int(entry.name))
    return pids


def tiered_kv(metrics: dict) -> dict[str, float]:
    return {tier: metrics[("kvtier:kv_bytes", (("path", "tiered"), ("tier", tier)))]
            for tier in ("device", "host", "storage")}


def test_a_tiered_request_reports_its_kv_tiers_while_it_runs_and_counts_cold_reads_and_scorer_restarts(
        server, raw):
    url = server[0].url
    prompt = "A lighthouse keeper writes down every ship that passes the cape at night. " * 30  # ~480 tokens
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    before = scrape(url, KEY)
    assert set(tiered_kv(before).values()) == {0}
    lines, during = [], None
    with raw.stream("POST", "/v1/completions", json=body) as response:
        for line in filter(None, response.iter_lines()):
            lines.append(line)
            if len(lines) == 3:  # three tokens in: the prompt is spread over the tiers, decoding goes on
                during = scrape(url, KEY)
                [scorer] = scorer_processes()
                os.kill(scorer, signal.SIGKILL)
    after = scrape(url, KEY)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 16
    assert during[("kvtier:num_requests_running", (("path", "tiered"),))] == 1
    live = tiered_kv(during)
    assert live["device"] > 0 and live["storage"] > 0  # a 4 MiB share of the host: ~180 tokens fit
    assert moved(before, during, "kvtier:tiered_cold_read_bytes_total") > 0  # counted as they happen
    assert moved(before, after, "kvtier:tiered_scorer_restarts_total") == 1  # the killed scorer was replaced
    assert moved(during, after, "kvtier:tiered_cold_read_bytes_total") > 0
    assert set(tiered_kv(after).values()) == {0}  # the request's cache is gone
    assert after[("kvtier:num_requests_running", (("path", "tiered"),))] == 0


def test_a_short_prompt_beside_a_decoding_tiered_request_goes_in_while_the_tiered_one_sits_out(server, raw, client):
    url = server[0].url
    prompt = "A lighthouse keeper writes down every ship that passes the cape at night. " * 30  # ~480 tokens
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True,
            "ignore_eos": True}
    before, short = scrape(url, KEY), None
    with raw.stream("POST", "/v1/completions", json=body) as response:
        for line in filter(None, response.iter_lines()):
            if short is None:  # its first token is out: it decodes now
                short = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=2, temperature=0)
    after = scrape(url, KEY)
    assert short.usage.completion_tokens == 2
    assert moved(before, after, "kvtier:requests_total", path="tiered") == 1
    assert moved(before, after, "kvtier:tiered_sit_outs_total") >= 1  # the short prompt's forward ran alone


PARIS = "What is the capital of France? Answer in one word."


@pytest.mark.parametrize("path, filler", [("paged", 0), ("tiered", 60)])
def test_ignore_eos_generates_max_tokens_on_both_paths(client, server, path, filler):
    content = "Paris is the capital of France. " * filler + "\n" + PARIS  # 60 times: ~460 tokens, beyond the pool

    def ask(**extra):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                              max_tokens=20, temperature=0, **extra)

    before = scrape(server[0].url, KEY)
    free, forced = ask(), ask(extra_body={"ignore_eos": True})
    assert moved(before, scrape(server[0].url, KEY), "kvtier:requests_total", path=path) == 2
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens < 20
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 20
    assert "Paris" in free.choices[0].message.content
    assert forced.choices[0].message.content.startswith(free.choices[0].message.content)  # then past the end


def test_sampling_fields_choices_and_logprobs_work_on_the_tiered_path(client, server, raw):
    content = "Paris is the capital of France. " * 60 + "\n" + PARIS  # ~460 tokens, beyond the pool

    def ask(**fields):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                              max_tokens=6, **fields)

    before = scrape(server[0].url, KEY)
    greedy = ask(temperature=0)
    assert ask(temperature=1.5, seed=3, extra_body={"top_k": 1}).choices[0].message.content \
        == greedy.choices[0].message.content
    # Seeds are checked on the paged path (test_sampling.py), not here: a tiered sequence's migration is priced by
    # the fetch times it measures, so its hot pool, and at temperature 1 its samples, may differ from run to run.
    pair = ask(temperature=1.0, seed=7, n=2, logprobs=True, top_logprobs=1)
    assert [choice.index for choice in pair.choices] == [0, 1] and pair.usage.completion_tokens == 12
    for choice in pair.choices:
        assert len(choice.logprobs.content) == 6
        assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 1 for entry in choice.logprobs.content)
    assert moved(before, scrape(server[0].url, KEY), "kvtier:requests_total", path="tiered") == 3
    echoed = raw.post("/v1/completions", json={"model": MODEL, "prompt": content, "max_tokens": 2, "echo": True,
                                               "logprobs": 1})
    assert echoed.status_code == 400 and echoed.json()["error"]["param"] == "echo"


def test_a_client_that_gives_up_on_a_whole_answer_has_its_request_aborted(raw, server):
    before = scrape(server[0].url, KEY)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 300, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        raw.post("/v1/completions", json=body, timeout=0.5)  # the client closes the connection
    after = settled(server[0].url, KEY)
    assert moved(before, after, "kvtier:generation_tokens_total") < 300
    assert moved(before, after, "kvtier:request_success_total", finished_reason="length") == 0
    assert after[("kvtier:device_blocks_free", ())] == after[("kvtier:device_blocks_total", ())]


def test_models_and_health(client, server):
    assert [model.id for model in client.models.list()] == [MODEL]
    assert httpx.get(server[0].url + "/health").status_code == 200  # no key needed


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/v1/completions"])
def test_every_endpoint_but_health_wants_the_key(server, path):
    url = server[0].url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.request("POST" if "completions" in path else "GET", url, headers=headers,
                                 json={"model": MODEL, "prompt": "hi"})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server[0].url + "/v1", api_key="wrong", max_retries=0).models.list()


BAD_REQUESTS = [
    # (body or raw text, status, param, code)
    ("{not json", 400, None, "invalid_json"),
    ('["a list"]', 400, None, "invalid_body"),
    ({"prompt": "hi"}, 400, "model", "missing_parameter"),
    ({"model": MODEL}, 400, "prompt", "missing_parameter"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10 ** 6}, 400, "max_tokens", "context_length_exceeded"),
    ({"model": MODEL, "prompt": "hi " * 9000, "max_tokens": 1}, 400, "prompt", "context_length_exceeded"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "suffix": "!"}, 400, "suffix", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 99}, 400, "logprobs", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "tools": []}, 400, "tools", "unsupported_parameter"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": [1, 10 ** 9]}, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "seed": "7"}, 400, "seed", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "stream": True, "stream_options": {"usage": True}}, 400,
     "stream_options.usage", "unsupported_parameter"),
]


@pytest.mark.parametrize("body, status, param, code", BAD_REQUESTS)
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(raw, body, status, param, code):
    if isinstance(body, str):
        response = raw.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    else:
        response = raw.post("/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code)
    assert error["message"] and "\n" not in error["message"]
    assert raw.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_chat_errors_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as missing:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert missing.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as role:
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}], max_tokens=2)
    assert role.value.body["param"].startswith("messages.0")
    with pytest.raises(openai.NotFoundError) as model:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert (model.value.body["param"], model.value.body["code"]) == ("model", "model_not_found")
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 9000}],
                                       max_tokens=2)
    assert (long.value.body["param"], long.value.body["code"]) == ("prompt", "context_length_exceeded")
