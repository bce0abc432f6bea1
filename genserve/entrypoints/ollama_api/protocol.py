"""Request shapes of the Ollama API (the fields the official `ollama` client sends). Unknown
fields (and options this server has no use for, such as num_ctx) are tolerated."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from genserve.entrypoints.lenient import LenientModel


class Options(LenientModel):
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    num_predict: int | None = None  # -1 (or absent): up to the context
    stop: list[str] | str | None = None
    seed: int | None = None
    repeat_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)


class ToolCallFunction(LenientModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(LenientModel):
    function: ToolCallFunction


class Message(LenientModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


class Common(LenientModel):
    model: str = Field(min_length=1)
    stream: bool = True  # Ollama streams unless told not to
    format: Literal["json", ""] | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: str | int | float | None = None  # accepted; models stay loaded
    think: bool | str | None = None


class ChatRequest(Common):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(Common):
    prompt: str = ""
    system: str | None = None
    images: list[str] | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None


class ShowRequest(LenientModel):
    model: str | None = None
    name: str | None = None  # older clients


class EmbedRequest(LenientModel):
    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool = True  # cut inputs longer than the context instead of refusing them
    dimensions: int | None = Field(default=None, ge=1)
    options: dict[str, Any] | None = None  # accepted; nothing applies to embeddings
    keep_alive: str | int | float | None = None
