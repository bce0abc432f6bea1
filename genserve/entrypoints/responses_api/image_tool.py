"""The built-in `image_generation` tool of /v1/responses: the gateway's diffusion runtime draws
the picture in process, the way /v1/images/generations does, and it comes back as an
`image_generation_call` output item.

When the tool runs (`plan`): OpenAI's model decides and writes a revised prompt; here the rule
is fixed, so a client can tell what happens from its request alone:
- `tool_choice: {"type": "image_generation"}` runs it;
- `"auto"` (or none) and `"required"` run it when it is the only tool in `tools`; next to
  function tools they are a 400 (name the tool to use in `tool_choice`);
- `"none"`, or a named function, never run it (the model answers as without it).
The prompt is the text of the latest user message of this request's `input`, as written
(`revised_prompt` repeats it). A turn that runs the tool answers with the picture alone (one
`image_generation_call` item, no message; no LLM tokens are used); a later turn continuing it
with `previous_response_id` shows the picture to its model (`translate.attach_pictures`).

Options: `size` ("WxH" or "auto"), `output_format` (png, jpeg, webp), `output_compression`
(jpeg / webp quality), `partial_images` (0-3: streamed previews of the denoising, from the
runtime's per-step previews), `model` (a served text-to-image model); `quality`, `moderation`
and `input_fidelity` are accepted and have no effect. Extensions: `seed`,
`num_inference_steps`, `guidance_scale`, `negative_prompt`."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from genserve.entrypoints.admission import new_rid
from genserve.entrypoints.diffusion.serving import DiffusionRun, error_from_event
from genserve.entrypoints.errors import APIError, bad_request
from genserve.entrypoints.images.streaming import partial_steps
from genserve.multimodal_gen.encoding import encode_image
from genserve.multimodal_gen.messages import (
    STATUS_BAD_INPUT,
    TEXT_TO_IMAGE,
    DiffusionEvent,
    DiffusionRequest,
    ErrorEvent,
    ResultEvent,
    StepEvent,
)
from genserve.multimodal_gen.validation import parse_size

from .protocol import ImageGenerationTool, ResponsesRequest, ToolChoiceObject
from .translate import parse_item

if TYPE_CHECKING:
    from genserve.entrypoints.state import GatewayState

Event = dict[str, Any]
FORMATS = ("png", "jpeg", "webp")


@dataclass(frozen=True)
class ImagePlan:
    """A checked call of the tool: its options, the model that draws and the prompt."""

    tool: ImageGenerationTool
    where: str  # "tools.<k>", for error messages
    model: str
    width: int | None
    height: int | None
    prompt: str


def _image_tools(body: ResponsesRequest) -> list[tuple[str, ImageGenerationTool]]:
    """Every image_generation tool of the request, parsed and checked (400 naming the bad
    option), whether or not it runs."""
    found = []
    for k, raw in enumerate(body.tools or []):
        if raw.get("type") != "image_generation":
            continue
        where = f"tools.{k}"
        tool = parse_item(ImageGenerationTool, raw, where)
        if tool.output_format not in FORMATS:
            raise bad_request(f"{where}.output_format: {tool.output_format!r} is not supported; "
                              f"give one of {', '.join(FORMATS)}.",
                              param=f"{where}.output_format")
        if tool.background == "transparent":
            raise bad_request(f"{where}.background: transparent backgrounds are not supported "
                              "(the diffusion models draw opaque pictures).",
                              param=f"{where}.background")
        if tool.action == "edit" or tool.input_image_mask is not None:
            raise bad_request(f"{where}: the image_generation tool draws new pictures from text; "
                              "editing an image is not supported (use /v1/images/edits).",
                              param=f"{where}.action")
        found.append((where, tool))
    if len(found) > 1:
        raise bad_request("give at most one image_generation tool.", param=found[1][0])
    return found


def _runs(body: ResponsesRequest, found: bool) -> bool:
    """Whether the tool runs in this turn (the rule in the module docstring)."""
    choice = body.tool_choice
    if isinstance(choice, ToolChoiceObject) and choice.type == "image_generation":
        if not found:
            raise bad_request("tool_choice names image_generation, but 'tools' holds no "
                              "image_generation tool.", param="tool_choice")
        return True
    if not found or choice == "none" or isinstance(choice, ToolChoiceObject):
        return False
    if len(body.tools or []) > 1:
        raise bad_request("the image_generation tool next to other tools needs a tool_choice "
                          "that picks one: {\"type\": \"image_generation\"} or a named "
                          "function.", param="tool_choice")
    return True


def _prompt(messages: list[dict[str, Any]]) -> str:
    """The text of the latest user message of this request's input."""
    for message in reversed(messages):
        if message["role"] != "user":
            continue
        content = message["content"]
        if isinstance(content, list):
            if any(part["type"] == "image_url" for part in content):
                raise bad_request("the image_generation tool draws from text; the user message "
                                  "holds an image, which it cannot edit.", param="input")
            content = "".join(part["text"] for part in content)
        if content.strip():
            return content
        break
    raise bad_request("the image_generation tool draws the latest user message's text, and "
                      "this request's input ends without one.", param="input")


def plan(state: GatewayState, body: ResponsesRequest,
         messages: list[dict[str, Any]]) -> ImagePlan | None:
    """The tool call this request makes (None when the tool does not run); 400 for bad
    options, for a server without a text-to-image model, and for input without a prompt."""
    found = _image_tools(body)
    if not _runs(body, bool(found)):
        return None
    where, tool = found[0]
    client = state.diffusion_client
    if client is None:
        raise bad_request("the image_generation tool needs a text-to-image model, and this "
                          "server serves no diffusion model (it was started with "
                          "--no-diffusion or without a diffusion model).", param=where,
                          code="image_generation_not_available")
    served = [s["id"] for s in client.list_models() if s.get("task") == TEXT_TO_IMAGE]
    model = tool.model or client.default_model(TEXT_TO_IMAGE)
    if model is None or model not in served:
        have = ", ".join(served) or "none"
        what = (f"model {tool.model!r} is not a served text-to-image model" if tool.model
                else "this server serves no text-to-image model")
        raise bad_request(f"{where}: the image_generation tool's {what} (text-to-image models "
                          f"served: {have}).", param=f"{where}.model",
                          code="image_generation_not_available")
    width = height = None
    if tool.size not in (None, "auto"):
        try:
            width, height = parse_size(tool.size)
        except ValueError as exc:
            raise bad_request(f"{where}.size: {exc}", param=f"{where}.size") from None
    return ImagePlan(tool, where, model, width, height, _prompt(messages))


class ImageCall:
    """One run of the tool. Creating it takes the diffusion model's admission slot (503 when
    full); `start` waits for the runtime's first event, so that input the model rejects (a
    size it cannot draw) is a 400 before any byte of a stream is sent; `events` yields the
    partial-image events and completes `item`; `close` gives the slot back."""

    def __init__(self, state: GatewayState, plan: ImagePlan, output_index: int,
                 stream: bool) -> None:
        assert state.diffusion_client is not None  # `plan` checked it
        tool = plan.tool
        self.plan = plan
        self.output_index = output_index
        self.quality = max(1, tool.output_compression if tool.output_compression is not None
                           else 90)
        self.item: dict[str, Any] = {
            "id": "ig_" + uuid.uuid4().hex, "type": "image_generation_call",
            "status": "in_progress", "result": None, "revised_prompt": plan.prompt,
            "action": "generate", "background": tool.background or "auto",
            "output_format": tool.output_format, "quality": tool.quality or "auto",
            "size": tool.size or "auto"}
        req = DiffusionRequest(
            rid=new_rid("igc-"), model=plan.model, prompt=plan.prompt,
            negative_prompt=tool.negative_prompt, width=plan.width, height=plan.height,
            num_inference_steps=tool.num_inference_steps, guidance_scale=tool.guidance_scale,
            seed=tool.seed,
            # Previews only for streamed partial images; else the result alone.
            preview=stream and tool.partial_images > 0, progress=False)
        self.run = DiffusionRun(state.diffusion_client, state.admission, state.metrics, req)
        self._events: AsyncIterator[DiffusionEvent] = self.run.events()
        self._first: DiffusionEvent | None = None

    def where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": self.output_index}

    async def start(self) -> None:
        try:
            first = await self._events.__anext__()
        except StopAsyncIteration:
            first = ErrorEvent(self.run.req.rid, "the diffusion engine ended the request "
                               "without a result", 503)
        if isinstance(first, ErrorEvent):
            await self.close()
            if first.status == STATUS_BAD_INPUT:  # an option the model cannot take
                where = self.plan.where
                raise bad_request(f"{where}: {first.message}", param=where)
            raise error_from_event(first)
        self._first = first

    async def _all(self) -> AsyncIterator[DiffusionEvent]:
        if self._first is not None:
            yield self._first
        async for event in self._events:
            yield event

    async def events(self) -> AsyncIterator[Event]:
        """`response.image_generation_call.partial_image` events (streamed requests with
        `partial_images`), then the item is completed; an engine error raises APIError."""
        wanted: set[int] | None = None
        sent = 0
        fmt = self.plan.tool.output_format
        async for event in self._all():
            if isinstance(event, StepEvent) and event.preview is not None:
                if wanted is None:
                    wanted = partial_steps(event.total_steps, self.plan.tool.partial_images)
                if event.step not in wanted:
                    continue
                frame = event.preview[0]
                data = await asyncio.to_thread(encode_image, frame, fmt, self.quality)
                h, w = frame.shape[:2]
                yield {"type": "response.image_generation_call.partial_image", **self.where(),
                       "partial_image_b64": base64.b64encode(data).decode(),
                       "partial_image_index": sent, "size": f"{w}x{h}", "output_format": fmt,
                       "quality": self.item["quality"], "background": self.item["background"]}
                sent += 1
            elif isinstance(event, ResultEvent):
                frame = event.outputs[0][0]
                data = await asyncio.to_thread(encode_image, frame, fmt, self.quality)
                h, w = frame.shape[:2]
                self.item.update(status="completed", result=base64.b64encode(data).decode(),
                                 size=f"{w}x{h}")
                return
            elif isinstance(event, ErrorEvent):
                raise error_from_event(event)
        raise APIError(503, "the diffusion engine ended the request without a result")

    async def close(self) -> None:
        """Stop the request if it still runs (the client left) and give its slot back."""
        with contextlib.suppress(RuntimeError):  # the body is still inside the generator
            await self._events.aclose()
        self.run.close()
