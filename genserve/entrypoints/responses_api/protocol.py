"""Request shapes of OpenAI's Responses API (the fields the official `openai` client sends).
Unknown fields are tolerated, as for chat (`entrypoints/lenient.py`).

`input` items are kept as dicts here and read one by one in `translate.py`, so that a bad item
is answered with a 400 naming it (`input.2: ...`) instead of a union's list of mismatches."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from genserve.entrypoints.lenient import LenientModel


class InputText(LenientModel):
    type: Literal["input_text", "output_text"]  # output_text: an assistant turn sent back
    text: str


class InputImage(LenientModel):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class MessageItem(LenientModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(LenientModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(LenientModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[dict[str, Any]]


class FunctionTool(LenientModel):
    """A tool in the Responses flat shape: `{"type": "function", "name", "parameters"}`."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(LenientModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(LenientModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted; no effect on this server


class ToolChoiceObject(LenientModel):
    type: str
    name: str | None = None


class ResponsesRequest(LenientModel):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None  # effort / summary: accepted, no effect
    user: str | None = None
    # Known but not honoured: a value other than the default is a 400 (translate.py).
    background: bool | None = None
    conversation: Any = None
    # Extensions the official client sends through `extra_body`.
    seed: int | None = None
    top_k: int | None = None
