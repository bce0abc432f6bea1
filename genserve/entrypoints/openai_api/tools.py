"""The request side of tool calling: check `tools` / `tool_choice`, render the tools into the
prompt, and build the grammar that enforces `tool_choice: "required"` or a named function.

When the model's chat template renders tools (`apply_chat_template(tools=...)` changes the
prompt), the template does it and the parser is detected from what it wrote. When it does not
(the default SmolLM2's template ignores tools), genserve writes the tools into the system
prompt itself, in the Hermes format, and parses that format back:

    <tools> one JSON function description per line </tools>
    <tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from genserve.entrypoints.errors import bad_request
from genserve.entrypoints.openai_api.protocol import ChatCompletionRequest, ChatTool
from genserve.entrypoints.openai_api.tool_calls import ToolCallParser
from genserve.srt.client import LLMEngineClient

SYSTEM_PROMPT = (
    "You can call functions to answer the user. The functions are described below as JSON "
    "inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, write a JSON object with its name and arguments inside "
    "<tool_call></tool_call> tags, one per call:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n'
    "</tool_call>"
)
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "genserve_probe_fn",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


@dataclass
class ToolPlan:
    """How this request uses tools."""

    tools: list[dict[str, Any]]  # OpenAI tool dicts passed to the chat template
    own_rendering: bool  # genserve writes the tools into the system prompt (Hermes format)
    parser: ToolCallParser
    grammar: dict[str, Any]  # engine sampling params enforcing the call ({} for "auto")


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def validate_tools(body: ChatCompletionRequest) -> None:
    tools = body.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("Tool names must be unique.", param="tools")
    for k, tool in enumerate(tools):
        try:
            Draft202012Validator.check_schema(_parameters(tool))
        except SchemaError as exc:
            raise bad_request(
                f"tools[{k}].function.parameters is not a valid JSON schema: {exc.message}",
                param=f"tools.{k}.function.parameters",
            ) from None
        if _parameters(tool).get("type", "object") != "object":
            raise bad_request(
                f"tools[{k}].function.parameters must describe an object.",
                param=f"tools.{k}.function.parameters",
            )
    choice = body.tool_choice
    if choice in ("required",) and not tools:
        raise bad_request(
            "tool_choice 'required' needs at least one tool in 'tools'.", param="tool_choice"
        )
    if choice is not None and not isinstance(choice, str):
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice names the function {choice.function.name!r}, "
                f"which is not in 'tools' ({', '.join(names) or 'none'}).",
                param="tool_choice",
            )


def template_renders_tools(client: LLMEngineClient) -> str | None:
    """The probe prompt when the chat template writes tools into the prompt, else None."""
    msgs = [{"role": "user", "content": "hi"}]
    try:
        with_tools = client.apply_chat_template(msgs, True, tools=[_PROBE_TOOL])
    except (TypeError, ValueError):  # a template (or client) that takes no tools
        return None
    plain = client.apply_chat_template(msgs, True)
    return with_tools if with_tools != plain and "genserve_probe_fn" in with_tools else None


def detect_parser(rendered: str | None) -> str:
    """The output format a template asks for, from the prompt it renders with tools."""
    if rendered is None or "<tool_call>" in rendered:
        return "hermes"
    if "[AVAILABLE_TOOLS]" in rendered or "[TOOL_CALLS]" in rendered:
        return "mistral"
    if "<|python_tag|>" in rendered or "ipython" in rendered or '"parameters"' in rendered:
        return "llama3"
    return "hermes"


def _call_schema(tools: list[ChatTool], max_calls: int | None) -> dict[str, Any]:
    """JSON schema of the array of calls the model must write: each item names one of
    `tools` and carries arguments valid for it."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def plan_tools(
    client: LLMEngineClient,
    body: ChatCompletionRequest,
    configured_parser: str | None,
    grammar_ok: bool,
) -> ToolPlan | None:
    """None when the request does not use tools (none given, or tool_choice "none")."""
    validate_tools(body)
    if not body.tools or body.tool_choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    rendered = template_renders_tools(client)
    own = rendered is None
    choice = body.tool_choice
    if choice is None or choice == "auto":
        parser = ToolCallParser(configured_parser or detect_parser(rendered))
        return ToolPlan(tools, own, parser, {})
    if not grammar_ok:
        raise bad_request(
            "tool_choice 'required' or a named function needs constrained "
            "decoding, which this engine does not have.",
            param="tool_choice",
        )
    if isinstance(choice, str):  # "required"
        chosen, max_calls = body.tools, (None if body.parallel_tool_calls is not False else 1)
    else:
        chosen = [t for t in body.tools if t.function.name == choice.function.name]
        max_calls = 1
    grammar = {"json_schema": json.dumps(_call_schema(chosen, max_calls))}
    return ToolPlan(tools, own, ToolCallParser("json"), grammar)


def own_tool_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Messages for a template that ignores tools: the tool descriptions join the system
    prompt, assistant tool calls become <tool_call> blocks, tool results <tool_response>."""
    lines = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    system = SYSTEM_PROMPT.format(tools=lines)
    out: list[dict[str, Any]] = []
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            blocks = [msg.get("content") or ""]
            for call in msg["tool_calls"]:
                fn = call.get("function", {})
                args = fn.get("arguments", "{}")
                args = json.loads(args) if isinstance(args, str) and _is_json(args) else args
                blocks.append(
                    "<tool_call>\n"
                    + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
                    + "\n</tool_call>"
                )
            out.append({"role": "assistant", "content": "\n".join(b for b in blocks if b)})
        elif msg["role"] == "tool":
            out.append(
                {
                    "role": "user",
                    "content": f"<tool_response>\n{msg.get('content') or ''}\n</tool_response>",
                }
            )
        else:
            out.append({k: v for k, v in msg.items() if k != "tool_calls"})
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
