"""Which request fields work, which are ignored, which are refused (and docs/usage.md's table of them)."""

import re
from pathlib import Path

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kvtier.http.error_responses import validation_error
from kvtier.http.schemas import AT_DEFAULT_ONLY, CHAT_ONLY, COMPLETION_ONLY, IGNORED, ChatCompletionRequest, \
    CompletionRequest

USAGE = Path(__file__).parents[2] / "docs" / "usage.md"
COMPLETION = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refusal(schema, body) -> tuple[str | None, str, str]:
    """(param, code, message) of the 400 the server answers `body` with."""
    with pytest.raises(ValidationError) as error:
        schema.model_validate(body)
    answer = validation_error(RequestValidationError(error.value.errors()))
    return answer.param, answer.code, answer.message


@pytest.mark.parametrize("name", IGNORED)
def test_fields_that_cannot_change_the_output_are_accepted_and_ignored(name):
    for schema, body in ((CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)):
        request = schema.model_validate(body | {name: {"anything": [1, 2]}})
        assert name not in request.model_dump(exclude_unset=True)


@pytest.mark.parametrize("name, allowed", sorted(AT_DEFAULT_ONLY.items()))
def test_fields_not_built_are_accepted_at_their_no_op_value_only(name, allowed):
    schema, body = (ChatCompletionRequest, CHAT) if name in CHAT_ONLY else (CompletionRequest, COMPLETION)
    for value in allowed:
        schema.model_validate(body | {name: value})
    param, code, message = refusal(schema, body | {name: "something else"})
    assert (param, code) == (name, "unsupported_parameter") and name in message


@pytest.mark.parametrize("name", sorted(set(CHAT_ONLY + COMPLETION_ONLY)))
def test_the_other_endpoints_fields_are_unknown(name):
    schema, body = (CompletionRequest, COMPLETION) if name in CHAT_ONLY else (ChatCompletionRequest, CHAT)
    assert refusal(schema, body | {name: AT_DEFAULT_ONLY[name][-1]})[:2] == (name, "unsupported_parameter")


def test_no_tools_is_fine_and_tool_calls_are_refused_clearly():
    accepted = CHAT | {"tools": [], "tool_choice": "none", "parallel_tool_calls": False}
    ChatCompletionRequest.model_validate(accepted)
    ChatCompletionRequest.model_validate(CHAT | {"tool_choice": "auto"})
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    param, code, message = refusal(ChatCompletionRequest, CHAT | {"tools": [tool]})
    assert (param, code) == ("tools", "unsupported_parameter") and "tool calls are not supported" in message
    assert refusal(ChatCompletionRequest, CHAT | {"tool_choice": "required"})[:2] == ("tool_choice",
                                                                                       "unsupported_parameter")


def test_response_formats_and_logprob_options_are_checked():
    for form in ({"type": "text"}, {"type": "json_object"},
                 {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}):
        ChatCompletionRequest.model_validate(CHAT | {"response_format": form})
        CompletionRequest.model_validate(COMPLETION | {"response_format": form})
    assert refusal(ChatCompletionRequest, CHAT | {"response_format": {"type": "json_schema"}})[0] == "response_format"
    assert refusal(ChatCompletionRequest, CHAT | {"response_format": {"type": "yaml"}})[0] == "response_format.type"
    assert refusal(ChatCompletionRequest, CHAT | {"top_logprobs": 2})[0] == "top_logprobs"
    assert ChatCompletionRequest.model_validate(CHAT | {"logprobs": True, "top_logprobs": 2}).reported_logprobs == 2
    assert ChatCompletionRequest.model_validate(CHAT | {"logprobs": True}).reported_logprobs == 0
    assert CompletionRequest.model_validate(COMPLETION | {"logprobs": 0}).reported_logprobs == 0
    assert CompletionRequest.model_validate(COMPLETION).reported_logprobs is None


def documented_fields() -> dict[str, str]:
    """docs/usage.md's request-field table: field -> supported | ignored | refused."""
    rows = re.findall(r"^\| (`[^|]+) \| [^|]+ \| (supported|ignored|refused) \|", USAGE.read_text(), re.MULTILINE)
    return {name: status for names, status in rows for name in re.findall(r"`(\w+)`", names)}


def test_the_usage_doc_lists_every_field_with_what_becomes_of_it():
    documented = documented_fields()
    served = (set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields))
    assert {name for name in served} <= set(documented)
    assert {name for name, status in documented.items() if status == "ignored"} >= set(IGNORED)
    assert {name for name in AT_DEFAULT_ONLY if documented.get(name) != "refused"} == set()
    assert {name for name in served if documented[name] != "supported"} == {"tools", "tool_choice"}  # but empty
