"""Request shapes of the OpenAI-compatible API (the fields the official client sends).

Unknown fields are accepted and ignored (logged once per name, `entrypoints/lenient.py`).
Fields we know but cannot honour are declared here so that `common.reject_unsupported` can
answer a precise 400 when they carry a non-default value.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from genserve.entrypoints.errors import bad_request
from genserve.entrypoints.lenient import LenientModel


class StreamOptions(LenientModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(LenientModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingFields(LenientModel):
    """Shared by completions and chat."""

    model: str = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # metadata only
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # SGLang / vLLM extensions the official client sends through `extra_body`.
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    regex: str | None = None
    ebnf: str | None = None
    cache_salt: str | None = None
    rid: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    response_format: ResponseFormat | None = None  # extension (vLLM / SGLang accept it too)
    best_of: int | None = Field(default=None, ge=1)


class TextPart(LenientModel):
    type: Literal["text"]
    text: str


class ImageURL(LenientModel):
    url: str
    detail: str | None = None


class ImagePart(LenientModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(LenientModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class FunctionDefinition(LenientModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(LenientModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(LenientModel):
    name: str


class NamedToolChoice(LenientModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # Known but not honoured: a non-default value is a 400 (common.reject_unsupported).
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # extension: continue the last message when False


def chat_request_from(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request translated from another API's shape (Anthropic, Responses); its first
    validation problem is a 400 naming where it is."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise bad_request(f"Invalid request ({where}): {first.get('msg', 'invalid')}.") from None
