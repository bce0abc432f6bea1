"""POST /v1/responses (one Response object, or OpenAI's SSE event sequence), GET and DELETE
/v1/responses/{id}, on the chat endpoint's preparation (`ChatServing.prepare`), or on the
diffusion runtime when the built-in image_generation tool runs (`image_tool.py`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from genserve.entrypoints import sse
from genserve.entrypoints.errors import APIError, bad_request, not_found
from genserve.entrypoints.generation import GenerationGroup
from genserve.entrypoints.openai_api import common
from genserve.entrypoints.openai_api.serving_chat import PreparedChat
from genserve.srt.messages import GenerateOutput

from . import image_tool
from .image_tool import ImageCall
from .output import Event, OutputBuilder, length_limited
from .protocol import ResponsesRequest
from .store import ResponseStore, StoredResponse
from .translate import (
    PICTURES,
    attach_pictures,
    check_unsupported,
    input_messages,
    picture_url,
    to_chat,
)

if TYPE_CHECKING:
    from genserve.entrypoints.state import GatewayState

RESPONSE_STORE_CAPACITY = 1024  # responses kept for GET and previous_response_id (LRU)


def _unknown(response_id: str, param: str | None = None) -> APIError:
    return not_found(f"No response with id {response_id!r} is stored (it may have been sent "
                     "with store: false, deleted, or dropped from the bounded store).",
                     param=param, code="response_not_found")


def _assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the chat message a continued conversation renders."""
    text = "".join(part["text"] for item in items if item["type"] == "message"
                   for part in item["content"])
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    if calls:
        message["tool_calls"] = calls
    pictures = [picture_url(item["result"], item["output_format"]) for item in items
                if item["type"] == "image_generation_call" and item["result"]]
    if pictures:
        message[PICTURES] = pictures
    return message


# A turn answered by the image_generation tool alone runs no LLM.
NO_TOKENS = {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": 0}


class _Turn:
    """One POST /v1/responses: its request, prepared chat and id, and how it ends (the
    Response object, stored unless `store` is false)."""

    def __init__(self, body: ResponsesRequest, prep: PreparedChat | None,
                 messages: list[dict[str, Any]], store: ResponseStore) -> None:
        self.body = body
        self.prep = prep
        self.messages = messages  # the conversation so far, this request's input included
        self.store = store
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())

    def builder(self) -> OutputBuilder:
        assert self.prep is not None  # a turn that runs the LLM
        return OutputBuilder(self.prep.reasoning,
                             self.prep.plan.parser if self.prep.plan else None)

    def response(self, status: str, output: list[dict[str, Any]],
                 out: GenerateOutput | None) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text and body.text.format else None
        usage = NO_TOKENS if status == "completed" else None
        if out is not None:
            usage = {"input_tokens": out.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": out.cached_tokens},
                     "output_tokens": out.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": out.prompt_tokens + out.completion_tokens}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": body.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": body.store,
            "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": (fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                                else {"type": "text"})},
            "tool_choice": (body.tool_choice if isinstance(body.tool_choice, str | None)
                            else body.tool_choice.model_dump(exclude_none=True)) or "auto",
            "tools": list(body.tools or []),
            "truncation": "disabled", "usage": usage, "user": body.user,
            "metadata": body.metadata or {},
        }

    def finish(self, items: list[dict[str, Any]], out: GenerateOutput | None) -> dict[str, Any]:
        status = "incomplete" if out is not None and length_limited(out) else "completed"
        response = self.response(status, items, out)
        if self.body.store:
            self.store.put(self.id, StoredResponse(
                response, [*self.messages, _assistant_message(items)]))
        return response

    def full(self, outs: list[GenerateOutput]) -> dict[str, Any]:
        builder = self.builder()
        builder.update(outs[0])
        return self.finish(builder.items, outs[0])

    def _open_stream(self) -> tuple[Callable[[Event], bytes], list[bytes]]:
        """A stream's event writer (numbering events in order) and its opening events,
        response.created and response.in_progress."""
        seq = iter(range(1 << 62))

        def emit(event: Event) -> bytes:
            return sse.typed_event({**event, "sequence_number": next(seq)})

        start = self.response("in_progress", [], None)
        return emit, [emit({"type": "response.created", "response": start}),
                      emit({"type": "response.in_progress", "response": start})]

    async def stream(self, group: GenerationGroup,
                     events: AsyncIterator[tuple[int, GenerateOutput]]) -> AsyncIterator[bytes]:
        emit, opening = self._open_stream()
        for event in opening:
            yield event
        builder = self.builder()
        try:
            async for _, out in events:
                for event in builder.update(out):
                    yield emit(event)
                if out.finished:
                    final = self.finish(builder.items, out)
                    kind = ("response.incomplete" if final["status"] == "incomplete"
                            else "response.completed")
                    yield emit({"type": kind, "response": final})
        except APIError as exc:
            yield emit({"type": "error", "code": exc.code or exc.type, "message": exc.message,
                        "param": exc.param})
        finally:
            await group.close()

    # -- a turn answered by the image_generation tool ---------------------------------------

    async def image_full(self, call: ImageCall) -> dict[str, Any]:
        try:
            async for _ in call.events():
                pass
        finally:
            await call.close()
        return self.finish([call.item], None)

    async def image_stream(self, call: ImageCall) -> AsyncIterator[bytes]:
        """OpenAI's events of the tool: the item added, in_progress, generating, the partial
        images, completed, the item done; then response.completed."""
        emit, opening = self._open_stream()
        for event in opening:
            yield event
        yield emit({"type": "response.output_item.added", "output_index": call.output_index,
                    "item": dict(call.item)})
        yield emit({"type": "response.image_generation_call.in_progress", **call.where()})
        yield emit({"type": "response.image_generation_call.generating", **call.where()})
        try:
            async for event in call.events():
                yield emit(event)
            yield emit({"type": "response.image_generation_call.completed", **call.where()})
            yield emit({"type": "response.output_item.done", "output_index": call.output_index,
                        "item": call.item})
            yield emit({"type": "response.completed", "response": self.finish([call.item], None)})
        except APIError as exc:
            yield emit({"type": "error", "code": exc.code or exc.type, "message": exc.message,
                        "param": exc.param})
        finally:
            await call.close()


class ResponsesServing:
    """OpenAI's Responses API over the gateway's LLMs (one per app, `GatewayState`), with the
    bounded store of responses that `previous_response_id` continues."""

    def __init__(self, state: GatewayState, capacity: int = RESPONSE_STORE_CAPACITY) -> None:
        self.state = state
        self.store = ResponseStore(capacity)

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        history: list[dict[str, Any]] = []
        if body.previous_response_id:
            previous = self.store.get(body.previous_response_id)
            if previous is None:
                raise _unknown(body.previous_response_id, "previous_response_id")
            history = previous.messages
        messages = input_messages(body)
        check_unsupported(body)
        image = image_tool.plan(self.state, body, messages)
        if image is not None:
            self.state.resolve_llm(body.model)  # the conversation's model: 404 when unknown
            return await self._draw(_Turn(body, None, [*history, *messages], self.store), image)
        conversation, pictures = attach_pictures([*history, *messages])
        if pictures:
            self._check_vision(body.model)
        prep = await self.state.chat.prepare(to_chat(body, conversation))
        turn = _Turn(body, prep, [*history, *messages], self.store)
        return await common.respond(self.state, prep.client, prep.reqs, request, body.stream,
                                    turn.full, turn.stream)

    def _check_vision(self, model: str) -> None:
        """400 unless `model` takes the pictures the conversation holds."""
        client = self.state.resolve_llm(model)
        if "image" in client.modalities:
            return
        vision = [c.model_name for c in self.state.llm_clients if "image" in c.modalities]
        raise bad_request(
            f"The conversation holds a picture made by the image_generation tool, and model "
            f"{model!r} does not take image inputs; continue it with a vision model (served: "
            f"{', '.join(vision) or 'none'}).", param="model", code="image_input_not_supported")

    async def _draw(self, turn: _Turn, image: image_tool.ImagePlan) -> Response:
        call = ImageCall(self.state, image, 0, turn.body.stream)
        try:
            await call.start()
            if not turn.body.stream:
                return JSONResponse(await turn.image_full(call))
        except BaseException:
            await call.close()
            raise
        return sse.response(turn.image_stream(call), on_close=call.close)

    def retrieve(self, response_id: str) -> JSONResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise _unknown(response_id)
        return JSONResponse(stored.response)

    def delete(self, response_id: str) -> JSONResponse:
        if not self.store.delete(response_id):
            raise _unknown(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
