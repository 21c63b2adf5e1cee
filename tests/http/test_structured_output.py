"""response_format through xgrammar: every sampled output parses and validates, on a tiny random model.

The model is a 2-layer random Llama with smollm2's tokenizer: its near-uniform logits would almost
never write JSON by themselves, so every valid output is the token mask's doing. Skipped only
where xgrammar is not installed (`make test` installs it, with `make vllm`).
"""

import asyncio
import json

import httpx
import openai
import pytest
import tiny_models
from http_server import MODEL, running_server

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.model

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colour", "flags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "colour": {"enum": ["red", "green", "blue"]},
                         "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def tiny(llm, tmp_path_factory):
    """A server of a tiny random model that speaks through smollm2's tokenizer."""
    from kvtier.models.loader import LoadedModel

    model = tiny_models.tiny_llama(vocab_size=len(llm.tokenizer), head_dim=16, eos_token_id=llm.tokenizer.eos_token_id)
    tiny_llm = LoadedModel.wrap(model, tokenizer=llm.tokenizer)
    with running_server(tiny_llm, tmp_path_factory.mktemp("tiny"), device_blocks=256, swap="recompute",
                        max_num_seqs=32) as (thread, backend):
        yield thread, backend


def test_json_schema_outputs_sampled_at_temperature_1_all_validate(tiny):
    client = openai.AsyncOpenAI(base_url=tiny[0].url + "/v1", api_key="none", max_retries=0)

    async def ask(seed: int):
        return await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120, temperature=1.0,
                                                    n=25, seed=seed, response_format=FORMAT)

    async def ask_all():
        return await asyncio.gather(*(ask(seed) for seed in (0, 100, 200, 300)))  # choice i: seed + i

    choices = [choice for reply in asyncio.run(ask_all()) for choice in reply.choices]
    assert len(choices) == 100
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        value = json.loads(choice.message.content)  # strict: no raw control character in a string either
        jsonschema.validate(value, SCHEMA)
        assert list(value) == list(SCHEMA["properties"])  # in the schema's order
    assert len({choice.message.content for choice in choices}) > 50  # sampled, not one answer


def test_without_a_format_the_tiny_model_writes_no_json(tiny):
    client = openai.OpenAI(base_url=tiny[0].url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=1.0, n=5,
                                           seed=1)
    for choice in reply.choices:
        with pytest.raises(ValueError):
            json.loads(choice.message.content)


def test_json_object_and_text_formats_on_both_endpoints(tiny):
    client = openai.OpenAI(base_url=tiny[0].url + "/v1", api_key="none", max_retries=0)
    tokenizer = tiny[1].llm.tokenizer
    closing = {str(tokenizer.convert_tokens_to_ids(token)): 30 for token in ("}", '"')}  # short strings, small objects
    reply = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=60, temperature=1.0, n=8, seed=2,
                                      logit_bias=closing, extra_body={"response_format": {"type": "json_object"}})
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and isinstance(json.loads(choice.text), dict)
    free = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    text = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                          response_format={"type": "text"})
    assert text.choices[0].message.content == free.choices[0].message.content


@pytest.mark.parametrize("schema, problem", [({"type": "objectx"}, "objectx"),
                                             ({"type": "object", "required": "name"}, "required")])
def test_a_schema_that_cannot_be_compiled_is_a_400_saying_why(tiny, schema, problem):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}}
    response = httpx.post(tiny[0].url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "response_format" and problem in error["message"]
    assert "\n" not in error["message"] and ".cc:" not in error["message"]
