"""POST /v1/chat/completions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from genserve.entrypoints import sse
from genserve.entrypoints.errors import APIError, bad_request
from genserve.entrypoints.generation import (
    GenerationGroup,
    check_context,
    default_max_new_tokens,
    tokenize,
)
from genserve.entrypoints.image_inputs import load_images, process_images, require_images
from genserve.entrypoints.openai_api import common
from genserve.entrypoints.openai_api.protocol import ChatCompletionRequest, ChatMessage
from genserve.entrypoints.state import GatewayState
from genserve.srt.client import LLMEngineClient
from genserve.srt.messages import GenerateOutput


def _template_messages(client: LLMEngineClient, messages: list[ChatMessage]
                       ) -> tuple[list[dict[str, Any]], list[str]]:
    """Messages for the chat template, and the image URLs of their image parts in order
    (a vision model's template renders each {"type": "image"} part as its placeholder)."""
    rendered = []
    images: list[str] = []
    for k, msg in enumerate(messages):
        if msg.tool_calls or msg.role == "tool":
            raise bad_request("Tool calls are not supported.", param=f"messages.{k}")
        content: Any = msg.content
        if isinstance(content, list) and any(p.type == "image_url" for p in content):
            require_images(client, f"messages.{k}.content")
            parts: list[dict[str, Any]] = []
            for part in content:
                if part.type == "image_url":
                    images.append(part.image_url.url)
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": part.text})
            content = parts
        elif isinstance(content, list):
            content = "".join(part.text for part in content)  # type: ignore[union-attr]
        role = "system" if msg.role == "developer" else msg.role
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if msg.name:
            entry["name"] = msg.name
        rendered.append(entry)
    return rendered, images


def _grammar_params(client: LLMEngineClient, body: ChatCompletionRequest) -> dict[str, Any]:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return {}
    common.check_grammar(client, fmt.type)
    if fmt.type == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    schema = (fmt.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object.",
                          param="response_format")
    return {"json_schema": json.dumps(schema)}


def _validate(body: ChatCompletionRequest) -> None:
    if body.tools:
        raise bad_request("Tool calling ('tools') is not supported.", param="tools")
    if body.tool_choice not in (None, "none"):
        raise bad_request("'tool_choice' is not supported.", param="tool_choice")
    if body.top_logprobs and not body.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs': true.", param="top_logprobs")
    if body.max_tokens and body.max_completion_tokens and \
            body.max_tokens != body.max_completion_tokens:
        raise bad_request("Give only one of 'max_tokens' and 'max_completion_tokens'.",
                          param="max_completion_tokens")


async def create_chat_completion(state: GatewayState, body: ChatCompletionRequest,
                                 request: Request) -> Response:
    client = state.resolve_llm(body.model)
    common.reject_unsupported(client, body)
    _validate(body)
    extra = _grammar_params(client, body)
    messages, image_urls = _template_messages(client, body.messages)
    images = await load_images(state, client, image_urls, "messages")
    try:
        prompt = client.apply_chat_template(messages, body.add_generation_prompt)
    except ValueError as exc:
        raise bad_request(f"Cannot apply the chat template: {exc}", param="messages") from exc
    ids = await tokenize(client, prompt)
    mm_inputs = None
    if images:
        ids, mm_inputs = await process_images(client, ids, images, "messages")
    max_new = body.max_completion_tokens or body.max_tokens
    name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    check_context(client, len(ids), max_new, name)
    if max_new is None:
        max_new = default_max_new_tokens(client, len(ids))
    params = common.sampling_params(body, max_new, extra)
    reqs = common.fan_out(body, [ids], params, body.logprobs, body.top_logprobs or 0)
    for req in reqs:
        req.mm_inputs = mm_inputs
    response_id = common.completion_id("chatcmpl")
    return await common.respond(
        state, client, reqs, request, bool(body.stream),
        lambda outs: _full_response(client, body, response_id, outs),
        lambda group, events: _stream(client, body, response_id, group, events),
    )


def _full_response(client: LLMEngineClient, body: ChatCompletionRequest, response_id: str,
                   outs: list[GenerateOutput]) -> dict[str, Any]:
    top_n = body.top_logprobs or 0
    choices = [{
        "index": i,
        "message": {"role": "assistant", "content": out.text},
        "logprobs": common.chat_logprobs(client, out, 0, top_n) if body.logprobs else None,
        "finish_reason": common.finish_reason(out),
    } for i, out in enumerate(outs)]
    return {"id": response_id, "object": "chat.completion", "created": common.now(),
            "model": body.model, "choices": choices, "usage": common.usage(outs, body.n)}


async def _stream(client: LLMEngineClient, body: ChatCompletionRequest, response_id: str,
                  group: GenerationGroup, events: AsyncIterator[tuple[int, GenerateOutput]]
                  ) -> AsyncIterator[bytes]:
    created = common.now()
    opts = body.stream_options
    include_usage = opts is not None and opts.include_usage
    continuous = opts is not None and opts.continuous_usage_stats
    sent_chars = [0] * body.n
    sent_tokens = [0] * body.n
    started = [False] * body.n
    last: list[GenerateOutput | None] = [None] * body.n
    top_n = body.top_logprobs or 0

    def chunk(choice: dict[str, Any], usage: dict[str, Any] | None) -> bytes:
        payload: dict[str, Any] = {"id": response_id, "object": "chat.completion.chunk",
                                   "created": created, "model": body.model, "choices": [choice]}
        if include_usage:
            payload["usage"] = usage
        return sse.event(payload)

    try:
        async for i, out in events:
            last[i] = out
            delta: dict[str, Any] = {"content": out.text[sent_chars[i]:]}
            if not started[i]:
                delta = {"role": "assistant", **delta}
                started[i] = True
            new_tokens = out.completion_tokens > sent_tokens[i]
            if not (new_tokens or out.finished or delta.get("role")):
                continue
            logprobs = (common.chat_logprobs(client, out, sent_tokens[i], top_n)
                        if body.logprobs else None)
            sent_chars[i], sent_tokens[i] = len(out.text), out.completion_tokens
            choice = {"index": i, "delta": delta, "logprobs": logprobs,
                      "finish_reason": common.finish_reason(out)}
            yield chunk(choice, common.usage([out], 1) if continuous else None)
        if include_usage and all(o is not None for o in last):
            yield sse.event({"id": response_id, "object": "chat.completion.chunk",
                             "created": created, "model": body.model, "choices": [],
                             "usage": common.usage(last, body.n)})  # type: ignore[arg-type]
    except APIError as exc:
        yield sse.event(exc.body())
    finally:
        await group.close()
    yield sse.DONE
