"""Request bodies of /v1/completions and /v1/chat/completions, as OpenAI and vLLM's OpenAI server define them.

Every field either works, is ignored because it cannot change the output (`user`, `metadata`,
`store`, ...: IGNORED), or is refused. An unknown field is an "unsupported parameter" (400), and a
known field that would change the output and is not built (tool calls, `suffix`, vLLM's
`allowed_token_ids`, ...) is accepted only at its no-op value (AT_DEFAULT_ONLY), so a client never
gets an answer computed without what it asked for. Sampling values are checked once, by the
engine's SamplingParams (the server names the field in its 400); here only their types.
docs/usage.md lists every field with what becomes of it (a test holds the two together).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvtier.engine.sampling_params import MAX_LOGPROBS

PositiveInt = Annotated[int, Strict(), Field(ge=1)]
Logprobs = Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)]
MAX_STOP_STRINGS = 4
# Fields that cannot change the output: accepted with any value and ignored.
IGNORED = ("user", "metadata", "store", "service_tier", "request_id", "prompt_cache_key", "safety_identifier",
           "prediction", "parallel_tool_calls", "modalities")
# Fields that would change the output and are not built: accepted only at the value that changes nothing.
AT_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "priority": (None, 0), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "include_stop_str_in_output": (None, False),
    "allowed_token_ids": (None, []), "bad_words": (None, []), "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,), "return_tokens_as_token_ids": (None, False), "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0), "cache_salt": (None,), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,), "logits_processors": (None,),
    "vllm_xargs": (None,), "kv_transfer_params": (None,), "reasoning_effort": (None,), "audio": (None,),
    "web_search_options": (None,), "functions": (None, []), "function_call": (None, "none", "auto"),
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "documents": (None, []),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
}
COMPLETION_ONLY = ("suffix",)
CHAT_ONLY = ("reasoning_effort", "audio", "web_search_options", "functions", "function_call", "chat_template",
             "chat_template_kwargs", "documents", "add_generation_prompt", "continue_final_message")


def unsupported(message: str, param: str | None = None) -> PydanticCustomError:
    """A validation error that error_responses.py reports with code "unsupported_parameter" (`param`: the field
    it names, where the error's location does not)."""
    return PydanticCustomError("unsupported", message, {"param": param} if param else None)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: Any = None  # ignored: there is no obfuscation padding to leave out
    continuous_usage_stats: Literal[False] | None = None


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`text` (no constraint), `json_object` (any JSON object) or `json_schema` (JSON valid against a schema)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema comes with type "json_schema", and only with it')
        return self


class GenerationRequest(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: PositiveInt | None = None
    temperature: float | None = None  # OpenAI's default, 1
    top_p: float | None = None
    top_k: Annotated[int, Strict()] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Annotated[int, Strict()] | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)  # normalised to a list
    stop_token_ids: list[Annotated[int, Strict()]] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Strict()] | None = None
    logit_bias: dict[str, float] | None = None
    n: Annotated[int, Strict()] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _ignored_and_at_default(cls, body: Any) -> Any:
        """Drop the ignored fields; refuse a not-built field set to anything but its no-op value."""
        if not isinstance(body, dict):
            return body
        for name in set(body) & set(AT_DEFAULT_ONLY) - set(cls._other_endpoints_fields()):
            if not any(body[name] == allowed and type(body[name]) is type(allowed) for allowed in AT_DEFAULT_ONLY[name]):
                raise unsupported("not supported; leave it out", name)
        return {name: value for name, value in body.items() if name not in IGNORED and name not in AT_DEFAULT_ONLY
                or name in cls._other_endpoints_fields()}

    @classmethod
    def _other_endpoints_fields(cls) -> tuple[str, ...]:
        """Fields that belong to the other endpoint only: unknown here."""
        return ()

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        if len(strings) > MAX_STOP_STRINGS or any(not s for s in strings):
            raise ValueError(f"give at most {MAX_STOP_STRINGS} non-empty stop strings")
        return strings

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: Any) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return options

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias and not all(key.isdigit() for key in bias):
            raise ValueError("keys must be token ids, written as strings of digits")
        return bias

    @property
    def stop_strings(self) -> list[str]:
        return self.stop  # normalised to a list by the validator

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def reported_logprobs(self) -> int | None:
        """Alternatives per token the answer reports (None: no log-probabilities)."""
        return None


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int]
    echo: bool = False
    best_of: Annotated[int, Strict()] | None = None
    logprobs: Logprobs | None = None

    @classmethod
    def _other_endpoints_fields(cls) -> tuple[str, ...]:
        return CHAT_ONLY

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str] | list[int]) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise unsupported("one prompt per request is supported")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @field_validator("best_of")
    @classmethod
    def _not_streamed(cls, best_of: int | None, info: Any) -> int | None:
        if best_of is not None and best_of > 1 and info.data.get("stream"):
            raise ValueError("best_of cannot be used with stream: the best choices are known only at the end")
        return best_of

    @property
    def reported_logprobs(self) -> int | None:
        """Alternatives per token the answer reports (None: no log-probabilities)."""
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @classmethod
    def _other_endpoints_fields(cls) -> tuple[str, ...]:
        return COMPLETION_ONLY

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int | None, info: Any) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools: list[Any] | None) -> None:
        if tools:
            raise unsupported("tool calls are not supported; send no tools (or tools: [])")
        return None

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, choice: str | dict[str, Any] | None) -> None:
        if choice not in (None, "none", "auto"):
            raise unsupported('tool calls are not supported; tool_choice may only be "none" (or "auto", with no tools)')
        return None

    @property
    def token_limit(self) -> int | None:
        """`max_completion_tokens` (the newer name) or `max_tokens`."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def reported_logprobs(self) -> int | None:
        """Alternatives per token the answer reports (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None
