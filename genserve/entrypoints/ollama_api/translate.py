"""Ollama chat / generate requests as chat completion requests, so that the Ollama API runs on
the chat endpoint's prompt rendering, image path, tool calls and constrained decoding."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from genserve.entrypoints.errors import bad_request
from genserve.entrypoints.openai_api.protocol import ChatCompletionRequest
from genserve.entrypoints.openai_api.tool_calls import new_call_id

from .protocol import ChatRequest, Common, GenerateRequest, Message


def served_name(model: str, names: list[str]) -> str:
    """Ollama clients name models `name:tag`; `x:latest` means `x` when only `x` is served."""
    if model not in names and model.endswith(":latest") and model[:-7] in names:
        return model[:-7]
    return model


def _user(content: str, images: list[str] | None) -> dict[str, Any]:
    if not images:
        return {"role": "user", "content": content}
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": image}}
                                   for image in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": content}]}


def _message(msg: Message, k: int) -> dict[str, Any]:
    content = msg.content or ""
    if msg.images and msg.role != "user":
        raise bad_request(f"messages.{k}.images: only user messages may hold images.")
    if msg.role == "user":
        return _user(content, msg.images)
    entry: dict[str, Any] = {"role": msg.role, "content": content}
    if msg.tool_calls:
        entry["tool_calls"] = [{"id": new_call_id(), "type": "function", "function": {
            "name": c.function.name,
            "arguments": json.dumps(c.function.arguments, ensure_ascii=False)}}
            for c in msg.tool_calls]
    if msg.role == "tool" and msg.tool_name:
        entry["name"] = msg.tool_name
    return entry


def _sampling(body: Common) -> dict[str, Any]:
    fields: dict[str, Any] = {"stream": body.stream}
    opts = body.options
    if opts is not None:
        fields.update(temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k,
                      min_p=opts.min_p, stop=opts.stop, seed=opts.seed,
                      repetition_penalty=opts.repeat_penalty,
                      presence_penalty=opts.presence_penalty,
                      frequency_penalty=opts.frequency_penalty)
        if opts.num_predict is not None and opts.num_predict > 0:
            fields["max_tokens"] = opts.num_predict
        elif opts.num_predict == 0:
            raise bad_request("options.num_predict must be positive (or -1 for no limit).")
    if body.format == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "format", "schema": body.format}}
    return fields


def _validated(fields: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise bad_request(f"invalid request ({where}): {first.get('msg', 'invalid')}") from None


def chat_to_chat(body: ChatRequest, model: str) -> ChatCompletionRequest:
    messages = [_message(m, k) for k, m in enumerate(body.messages)]
    fields = {"model": model, "messages": messages, **_sampling(body)}
    if body.tools:
        fields["tools"] = body.tools
    return _validated(fields)


def generate_to_chat(body: GenerateRequest, model: str) -> ChatCompletionRequest:
    for name in ("raw", "suffix", "template", "context"):
        if getattr(body, name):
            raise bad_request(f"'{name}' is not supported by this server; send the prompt "
                              "(and system) to be rendered by the model's chat template.")
    messages = []
    if body.system:
        messages.append({"role": "system", "content": body.system})
    messages.append(_user(body.prompt, body.images))
    return _validated({"model": model, "messages": messages, **_sampling(body)})
