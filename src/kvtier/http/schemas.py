"""Request bodies of /v1/completions and /v1/chat/completions, as OpenAI defines them.

Every accepted field either works or is refused: an unknown field is an "unsupported parameter"
(400), and a known field we cannot honour (n > 1, penalties, logprobs, echo, ...) is accepted only
at its no-op value, so a client never gets an answer computed without what it asked for.
`ignore_eos` is vLLM's extension (benchmarks use it to fix the output length).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator
from pydantic_core import PydanticCustomError

PositiveInt = Annotated[int, Strict(), Field(ge=1)]
MAX_STOP_STRINGS = 4


def unsupported(message: str) -> PydanticCustomError:
    """A validation error that errors.py reports with code "unsupported_parameter"."""
    return PydanticCustomError("unsupported", message)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: PositiveInt | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: Annotated[int, Strict()] | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)  # normalised to a list
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

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

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise unsupported("only n=1 is supported")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise unsupported("penalties are not supported; leave it at 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, bias: dict[str, float] | None) -> None:
        if bias:
            raise unsupported("logit_bias is not supported")
        return None

    @property
    def stop_strings(self) -> list[str]:
        return self.stop  # normalised to a list by the validator

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

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

    @field_validator("echo", "suffix", "best_of", "logprobs")
    @classmethod
    def _not_supported(cls, value: Any, info: Any) -> Any:
        if not (value is None or value is False or (info.field_name == "best_of" and value == 1)):
            raise unsupported(f"{info.field_name} is not supported")
        return value


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
    top_logprobs: int | None = None

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any, info: Any) -> Any:
        if value:
            raise unsupported(f"{info.field_name} is not supported")
        return value

    @property
    def token_limit(self) -> int | None:
        """`max_completion_tokens` (the newer name) or `max_tokens`."""
        return self.max_completion_tokens or self.max_tokens
