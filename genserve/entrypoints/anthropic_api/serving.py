"""POST /v1/messages (non-streamed and as Anthropic's SSE event sequence) and
/v1/messages/count_tokens, on the chat endpoint's preparation (`ChatServing.prepare`)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from genserve.entrypoints.errors import APIError, body_for_path
from genserve.entrypoints.generation import GenerationGroup
from genserve.entrypoints.openai_api import common
from genserve.entrypoints.openai_api.reasoning import ReasoningStreamer
from genserve.entrypoints.openai_api.serving_chat import PreparedChat
from genserve.entrypoints.openai_api.tool_calls import ToolCall, ToolCallStreamer
from genserve.srt.messages import GenerateOutput

from .protocol import CountTokensRequest, MessagesRequest
from .translate import to_chat

if TYPE_CHECKING:
    from genserve.entrypoints.state import GatewayState


def _event(name: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps({"type": name, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {data}\n\n".encode()


def _stop(out: GenerateOutput, called: bool, stops: list[str] | None
          ) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output."""
    reason = out.finish_reason or {}
    if reason.get("type") == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    matched = reason.get("matched")
    if isinstance(matched, str) and stops and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def _tool_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": call.name,
            "input": json.loads(call.arguments)}


def _full(body: MessagesRequest, prep: PreparedChat, msg_id: str,
          out: GenerateOutput) -> dict[str, Any]:
    text, thought = out.text, None
    if prep.reasoning is not None:
        thought, text = prep.reasoning.split(out.text)
    calls: list[ToolCall] = []
    if prep.plan is not None:
        content, calls = prep.plan.parser.parse(text)
        text = content or ""
    blocks: list[dict[str, Any]] = []
    if thought:
        blocks.append({"type": "thinking", "thinking": thought, "signature": ""})
    if text or not calls:
        blocks.append({"type": "text", "text": text})
    blocks += [_tool_block(c) for c in calls]
    reason, sequence = _stop(out, bool(calls), body.stop_sequences)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": body.model,
            "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": out.prompt_tokens, "output_tokens": out.completion_tokens}}


class _Blocks:
    """Numbers the content blocks of a streamed message and opens / closes them in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open_type: str | None = None
        self.pinged = False

    def to(self, kind: str) -> list[bytes]:
        if self.open_type == kind:
            return []
        events = self.close()
        self.index += 1
        self.open_type = kind
        block: dict[str, Any] = ({"type": "text", "text": ""} if kind == "text"
                                 else {"type": "thinking", "thinking": "", "signature": ""})
        events.append(_event("content_block_start", {"index": self.index,
                                                     "content_block": block}))
        if not self.pinged:
            self.pinged = True
            events.append(_event("ping", {}))
        return events

    def close(self) -> list[bytes]:
        if self.open_type is None:
            return []
        self.open_type = None
        return [_event("content_block_stop", {"index": self.index})]

    def tool(self, call: ToolCall) -> list[bytes]:
        events = self.close()
        self.index += 1
        block = {**_tool_block(call), "input": {}}
        events += [
            _event("content_block_start", {"index": self.index, "content_block": block}),
            _event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": call.arguments}}),
            _event("content_block_stop", {"index": self.index}),
        ]
        return events


async def _stream(body: MessagesRequest, prep: PreparedChat, msg_id: str,
                  group: GenerationGroup, events: AsyncIterator[tuple[int, GenerateOutput]]
                  ) -> AsyncIterator[bytes]:
    yield _event("message_start", {"message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": body.model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(prep.prompt_ids), "output_tokens": 0}}})
    blocks = _Blocks()
    thinker = ReasoningStreamer(prep.reasoning) if prep.reasoning else None
    streamer = ToolCallStreamer(prep.plan.parser) if prep.plan else None
    sent = 0
    try:
        async for _, out in events:
            text, thought = out.text, ""
            if thinker is not None:
                thought, text = thinker.update(out.text, out.finished)
            if thought:
                for e in blocks.to("thinking"):
                    yield e
                yield _event("content_block_delta", {"index": blocks.index, "delta": {
                    "type": "thinking_delta", "thinking": thought}})
            if streamer is not None:
                delta, _ = streamer.update(text, out.finished)
            else:
                delta, sent = text[sent:], max(sent, len(text))
            if delta:
                for e in blocks.to("text"):
                    yield e
                yield _event("content_block_delta", {"index": blocks.index, "delta": {
                    "type": "text_delta", "text": delta}})
            if not out.finished:
                continue
            calls = prep.plan.parser.parse(text)[1] if prep.plan else []
            if blocks.index < 0 and not calls:
                for e in blocks.to("text"):
                    yield e
            for e in blocks.close():
                yield e
            for call in calls:
                for e in blocks.tool(call):
                    yield e
            reason, sequence = _stop(out, bool(calls), body.stop_sequences)
            yield _event("message_delta", {
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": out.completion_tokens}})
            yield _event("message_stop", {})
    except APIError as exc:
        yield _event("error", {"error": body_for_path("/v1/messages", exc)["error"]})
    finally:
        await group.close()


class MessagesServing:
    """Anthropic's Messages API over the gateway's LLMs (one per app, `GatewayState`)."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def create_message(self, body: MessagesRequest, request: Request) -> Response:
        prep = await self.state.chat.prepare(to_chat(body))
        msg_id = "msg_" + uuid.uuid4().hex[:24]
        return await common.respond(
            self.state, prep.client, prep.reqs, request, body.stream,
            lambda outs: _full(body, prep, msg_id, outs[0]),
            lambda group, events: _stream(body, prep, msg_id, group, events))

    async def count_tokens(self, body: CountTokensRequest) -> JSONResponse:
        prep = await self.state.chat.prepare(to_chat(body))
        return JSONResponse({"input_tokens": len(prep.prompt_ids)})
