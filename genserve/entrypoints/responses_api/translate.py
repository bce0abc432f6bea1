"""Responses requests as chat completion requests, so that /v1/responses runs on the chat
endpoint's prompt rendering, image path, tool-call machinery and grammar enforcement.

A conversation continued with `previous_response_id` is the stored chat messages of the
earlier turns (`store.StoredResponse.messages`) followed by this request's input; the earlier
`instructions` are not carried over, as OpenAI documents. A picture the image_generation tool
made (stored with its turn, or an `image_generation_call` item sent back) is shown to the model
as an image part of the next user message, through the chat path's image input (so its image
hash keys the prefix cache); the model must take images."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from genserve.entrypoints.errors import bad_request
from genserve.entrypoints.openai_api.protocol import ChatCompletionRequest, chat_request_from

from .protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    ImageGenerationCallItem,
    InputImage,
    InputText,
    MessageItem,
    ResponsesRequest,
)

# The key of an assistant message (in this module's messages and the store's) that holds the
# pictures the image_generation tool made in that turn, as data URLs. Chat templates take images
# in user messages only, so `to_chat` shows them with the next user message.
PICTURES = "generated_pictures"

# Input item types that carry nothing a chat prompt renders (reasoning sent back with the
# previous output): skipped.
_SKIPPED = {"reasoning"}


def parse_item(model: type[BaseModel], data: Any, where: str) -> Any:
    """`data` as `model`; a 400 naming the first bad field (`where.field`) else."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        field = f"{where}.{loc}" if loc else where
        raise bad_request(f"Invalid value for {field!r}: {first.get('msg', 'invalid')}.",
                          param=field) from None


def _parts(content: str | list[dict[str, Any]], role: str, where: str
           ) -> str | list[dict[str, Any]]:
    """A message item's content as chat content: a string, or text and image_url parts."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for j, raw in enumerate(content):
        here = f"{where}.{j}"
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind in ("input_text", "output_text"):
            parts.append({"type": "text", "text": parse_item(InputText, raw, here).text})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(raw.get("refusal", ""))})
        elif kind == "input_image":
            image = parse_item(InputImage, raw, here)
            if role != "user":
                raise bad_request(f"{here}: only user messages may hold images.", param=here)
            if not image.image_url:
                raise bad_request(f"{here}: give the image as 'image_url' (a URL or a data URL); "
                                  "file ids are not supported.", param=here)
            parts.append({"type": "image_url", "image_url": {"url": image.image_url}})
        else:
            raise bad_request(f"{here}: content type {kind!r} is not supported; use input_text "
                              "or input_image.", param=here)
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _output_text(output: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(output, str):
        return output
    texts = []
    for j, part in enumerate(output):
        if not isinstance(part, dict) or part.get("type") != "input_text":
            raise bad_request(f"{where}.{j}: a function_call_output holds text only.",
                              param=f"{where}.{j}")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def picture_url(b64: str, output_format: str | None) -> str:
    """A data URL of a base64 picture of the image_generation tool."""
    return f"data:image/{output_format or 'png'};base64,{b64}"


def attach_pictures(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The messages with each assistant turn's generated pictures (`PICTURES`) moved into the
    next user message as image parts before its text (a user message holding only them when
    none follows), and the number of pictures moved. The given dicts are not changed."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    moved = 0
    for message in messages:
        if PICTURES in message:
            message = dict(message)
            pending += message.pop(PICTURES)
        if message["role"] == "user" and pending:
            content = message["content"]
            text = ([{"type": "text", "text": content}] if isinstance(content, str)
                    else list(content))
            images = [{"type": "image_url", "image_url": {"url": url}} for url in pending]
            message = {**message, "content": [*images, *text]}
            moved += len(pending)
            pending = []
        out.append(message)
    if pending:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}
                                                for url in pending]})
        moved += len(pending)
    return out, moved


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """This request's `input` as chat messages (without `instructions`)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict[str, Any]] = []
    for k, raw in enumerate(body.input):
        where = f"input.{k}"
        if not isinstance(raw, dict):
            raise bad_request(f"{where}: an input item must be an object.", param=where)
        kind = raw.get("type", "message")
        if kind == "message":
            item = parse_item(MessageItem, raw, where)
            out.append({"role": item.role,
                        "content": _parts(item.content, item.role, f"{where}.content")})
        elif kind == "function_call":
            call = parse_item(FunctionCallItem, raw, where)
            entry = {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(entry)  # one turn, several calls
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [entry]})
        elif kind == "function_call_output":
            result = parse_item(FunctionCallOutputItem, raw, where)
            out.append({"role": "tool", "tool_call_id": result.call_id,
                        "content": _output_text(result.output, f"{where}.output")})
        elif kind == "image_generation_call":
            picture = parse_item(ImageGenerationCallItem, raw, where)
            if not picture.result:
                raise bad_request(f"{where}: an image_generation_call sent back needs its "
                                  "'result' (the base64 picture).", param=f"{where}.result")
            url = picture_url(picture.result, picture.output_format)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault(PICTURES, []).append(url)
            else:
                out.append({"role": "assistant", "content": "", PICTURES: [url]})
        elif kind not in _SKIPPED:
            raise bad_request(f"{where}: input item type {kind!r} is not supported; use "
                              "message, function_call, function_call_output or "
                              "image_generation_call items.",
                              param=where)
    if not out:
        raise bad_request("'input' holds no message.", param="input")
    return out


def _tools(body: ResponsesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if body.tools:
        tools = []
        for k, raw in enumerate(body.tools):
            kind = raw.get("type")
            if kind == "image_generation":
                continue  # the built-in tool runs in process (image_tool.py), not in the model
            if kind != "function":
                raise bad_request(f"tools.{k}: tool type {kind!r} is not supported; give "
                                  "function tools or the image_generation tool.",
                                  param=f"tools.{k}.type")
            tool = parse_item(FunctionTool, raw, f"tools.{k}")
            if not tool.name:
                raise bad_request(f"tools.{k}: a function tool needs a 'name'.",
                                  param=f"tools.{k}.name")
            tools.append({"type": "function", "function": {
                "name": tool.name, "description": tool.description,
                "parameters": tool.parameters, "strict": tool.strict}})
        if tools:
            fields["tools"] = tools
    choice = body.tool_choice
    if isinstance(choice, str):
        if "tools" in fields or choice == "required":  # "required" without tools is a 400
            fields["tool_choice"] = choice
    elif choice is not None:
        if choice.type != "function" or not choice.name:
            raise bad_request(f"tool_choice of type {choice.type!r} is not supported; give "
                              "auto, none, required or {\"type\": \"function\", \"name\": ...}.",
                              param="tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    return fields


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("text.format of type json_schema needs a 'schema'.",
                          param="text.format.schema")
    return {"type": "json_schema", "json_schema": {
        "name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}}


def check_unsupported(body: ResponsesRequest) -> None:
    """400 for the request fields this server knows but does not honour."""
    if body.background:
        raise bad_request("Background responses are not supported.", param="background")
    if body.conversation is not None:
        raise bad_request("'conversation' is not supported; continue a conversation with "
                          "'previous_response_id'.", param="conversation")


def to_chat(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request this Responses request means: `instructions`, then `conversation`
    (the stored history of a continued conversation and this request's `input_messages`, with
    the generated pictures attached: `attach_pictures`). `check_unsupported` runs first."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {
        "model": body.model, "messages": [*system, *conversation], **_tools(body),
        "max_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed, "stream": body.stream,
        "response_format": _response_format(body)}
    return chat_request_from(fields)
