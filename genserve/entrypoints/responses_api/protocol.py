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

    type: Literal["function"]
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ImageGenerationTool(LenientModel):
    """The built-in `{"type": "image_generation", ...}` tool (`image_tool.py`). `quality`,
    `moderation` and `input_fidelity` are accepted and have no effect (a diffusion model has no
    such knobs); options this server cannot honour are declared and answered with a 400 naming
    them."""

    type: Literal["image_generation"]
    model: str | None = None  # a served text-to-image model; None = the first one
    size: str | None = None  # "WIDTHxHEIGHT" or "auto" (the model's default)
    output_format: str = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100)  # jpeg / webp quality
    partial_images: int = Field(default=0, ge=0, le=3)
    quality: Literal["low", "medium", "high", "xhigh", "max", "auto"] | None = None
    background: Literal["transparent", "opaque", "auto"] | None = None  # transparent: a 400
    action: Literal["generate", "edit", "auto"] | None = None  # edit: a 400
    input_image_mask: dict[str, Any] | None = None
    moderation: str | None = None
    input_fidelity: str | None = None
    # Extensions (the diffusion request's own fields).
    seed: int | None = None
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = None
    negative_prompt: str | None = None


class ImageGenerationCallItem(LenientModel):
    """An `image_generation_call` output item sent back as input: its picture is shown to the
    model with the next user message."""

    type: Literal["image_generation_call"]
    id: str | None = None
    result: str | None = None
    output_format: str | None = None


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
    # Kept as dicts and read one by one in `translate.py` / `image_tool.py` (function tools,
    # the built-in image_generation tool), so a bad tool is a 400 naming it (`tools.1: ...`).
    tools: list[dict[str, Any]] | None = None
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
