"""POST /v1/responses (one Response object, or OpenAI's SSE event sequence), GET and DELETE
/v1/responses/{id}, on the chat endpoint's preparation (`ChatServing.prepare`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from genserve.entrypoints import sse
from genserve.entrypoints.errors import APIError, not_found
from genserve.entrypoints.generation import GenerationGroup
from genserve.entrypoints.openai_api import common
from genserve.entrypoints.openai_api.serving_chat import PreparedChat
from genserve.srt.messages import GenerateOutput

from .output import Event, OutputBuilder, length_limited
from .protocol import ResponsesRequest
from .store import ResponseStore, StoredResponse
from .translate import input_messages, to_chat

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
    return message


class _Turn:
    """One POST /v1/responses: its request, prepared chat and id, and how it ends (the
    Response object, stored unless `store` is false)."""

    def __init__(self, body: ResponsesRequest, prep: PreparedChat,
                 messages: list[dict[str, Any]], store: ResponseStore) -> None:
        self.body = body
        self.prep = prep
        self.messages = messages  # the conversation so far, this request's input included
        self.store = store
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())

    def builder(self) -> OutputBuilder:
        return OutputBuilder(self.prep.reasoning,
                             self.prep.plan.parser if self.prep.plan else None)

    def response(self, status: str, output: list[dict[str, Any]],
                 out: GenerateOutput | None) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text and body.text.format else None
        usage = None
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
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "truncation": "disabled", "usage": usage, "user": body.user,
            "metadata": body.metadata or {},
        }

    def finish(self, items: list[dict[str, Any]], out: GenerateOutput) -> dict[str, Any]:
        status = "incomplete" if length_limited(out) else "completed"
        response = self.response(status, items, out)
        if self.body.store:
            self.store.put(self.id, StoredResponse(
                response, [*self.messages, _assistant_message(items)]))
        return response

    def full(self, outs: list[GenerateOutput]) -> dict[str, Any]:
        builder = self.builder()
        builder.update(outs[0])
        return self.finish(builder.items, outs[0])

    async def stream(self, group: GenerationGroup,
                     events: AsyncIterator[tuple[int, GenerateOutput]]) -> AsyncIterator[bytes]:
        seq = iter(range(1 << 62))

        def emit(event: Event) -> bytes:
            return sse.typed_event({**event, "sequence_number": next(seq)})

        start = self.response("in_progress", [], None)
        yield emit({"type": "response.created", "response": start})
        yield emit({"type": "response.in_progress", "response": start})
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
        prep = await self.state.chat.prepare(to_chat(body, history, messages))
        turn = _Turn(body, prep, [*history, *messages], self.store)
        return await common.respond(self.state, prep.client, prep.reqs, request, body.stream,
                                    turn.full, turn.stream)

    def retrieve(self, response_id: str) -> JSONResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise _unknown(response_id)
        return JSONResponse(stored.response)

    def delete(self, response_id: str) -> JSONResponse:
        if not self.store.delete(response_id):
            raise _unknown(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
