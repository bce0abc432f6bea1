"""Request shapes of Anthropic's Messages API (the fields the official `anthropic` client
sends). Unknown fields are tolerated, as for chat (`entrypoints/lenient.py`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from genserve.entrypoints.lenient import LenientModel


class ImageSource(LenientModel):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class TextBlock(LenientModel):
    type: Literal["text"]
    text: str


class ImageBlock(LenientModel):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(LenientModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(LenientModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool | None = None


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock


class Message(LenientModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(LenientModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom"; server tools (web search ...) are refused


class ToolChoice(LenientModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(LenientModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(LenientModel):
    format: OutputFormat | None = None
    effort: str | None = None  # accepted; no effect on this server


class MessagesRequest(LenientModel):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None  # structured output: format.schema


class CountTokensRequest(LenientModel):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
