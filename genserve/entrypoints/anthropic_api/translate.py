"""Anthropic Messages requests as chat completion requests, so that /v1/messages runs on the
chat endpoint's prompt rendering, image path, tool-call machinery and grammar enforcement."""

from __future__ import annotations

import json
from typing import Any

from genserve.entrypoints.errors import bad_request
from genserve.entrypoints.openai_api.protocol import ChatCompletionRequest, chat_request_from

from .protocol import (
    CountTokensRequest,
    ImageBlock,
    Message,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)


def _image_url(block: ImageBlock, where: str) -> str:
    src = block.source
    if src.type == "base64":
        if not src.data or not src.media_type:
            raise bad_request(f"{where}: a base64 image source needs 'media_type' and 'data'.")
        return f"data:{src.media_type};base64,{src.data}"
    if not src.url:
        raise bad_request(f"{where}: a url image source needs 'url'.")
    return src.url


def _tool_result_text(block: ToolResultBlock, where: str) -> str:
    content = block.content
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        if any(isinstance(b, ImageBlock) for b in content):
            raise bad_request(f"{where}: images inside a tool_result are not supported.")
        text = "".join(b.text for b in content if isinstance(b, TextBlock))
    return f"Error: {text}" if block.is_error else text


def _messages(system: str | list[TextBlock] | None, messages: list[Message]
              ) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system:
        text = system if isinstance(system, str) else "\n".join(b.text for b in system)
        out.append({"role": "system", "content": text})
    for k, msg in enumerate(messages):
        where = f"messages.{k}.content"
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(msg.content):
            here = f"{where}.{j}"
            if isinstance(block, TextBlock):
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, ImageBlock):
                if msg.role != "user":
                    raise bad_request(f"{here}: only user messages may hold images.")
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block, here)}})
            elif isinstance(block, ToolUseBlock):
                if msg.role != "assistant":
                    raise bad_request(f"{here}: tool_use blocks belong to assistant messages.")
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
            else:
                if msg.role != "user":
                    raise bad_request(f"{here}: tool_result blocks belong to user messages.")
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": _tool_result_text(block, here)})
        if msg.role == "assistant":
            text = "".join(p["text"] for p in parts)
            entry: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
        elif parts:
            out.append({"role": "user", "content": parts})
    return out


def _tools(body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if body.tools:
        for k, tool in enumerate(body.tools):
            if tool.type not in (None, "custom"):
                raise bad_request(f"tools.{k}: server tool {tool.type!r} is not supported; "
                                  "give client tools with an input_schema.")
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type 'tool' needs a 'name'.")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice.type == "any":
            if not body.tools:
                raise bad_request("tool_choice 'any' needs at least one tool in 'tools'.")
            fields["tool_choice"] = "required"
        else:
            fields["tool_choice"] = choice.type
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


def to_chat(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request this Messages (or count_tokens) request means."""
    fields: dict[str, Any] = {"model": body.model,
                              "messages": _messages(body.system, body.messages),
                              **_tools(body)}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences,
                      stream=body.stream)
        fmt = body.output_config.format if body.output_config else None
        if fmt is not None:
            fields["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "output", "schema": fmt.schema_}}
    return chat_request_from(fields)
