"""Tool-call parsers: find the calls a model wrote in its output, whole or as it streams.

Formats (`--tool-call-parser`):
- `hermes` (Hermes, Qwen 2.5/3, and genserve's own rendering for templates without tools):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated for parallel calls;
- `llama3`: `{"name": ..., "parameters": {...}}` as the whole answer (optionally after
  `<|python_tag|>`), several separated by `;`;
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`;
- `json` (internal): the whole output is a JSON array of calls, as the grammar of
  `tool_choice: "required"` or a named function makes the model write it.

Every format is a region where the calls start, then JSON objects `{"name", "arguments" |
"parameters"}`; the scanner below reads those objects, complete or still being written, so the
stream can send a call's id and name first and then its argument text as it grows.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from genserve.entrypoints.config import TOOL_CALL_PARSERS

PARSERS = (*TOOL_CALL_PARSERS, "json")

_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_MARKERS = {
    "hermes": ("<tool_call>",),
    "mistral": ("[TOOL_CALLS]",),
    "llama3": ("<|python_tag|>",),
    "json": (),
}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object as text
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON object or array starting at text[start], None if open."""
    depth, in_str, escape = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _objects(text: str, start: int) -> list[tuple[int, int | None]]:
    """(start, end or None while open) of each top-level JSON object from text[start:]."""
    spans: list[tuple[int, int | None]] = []
    i = text.find("{", start)
    while i != -1:
        end = _value_end(text, i)
        spans.append((i, end))
        if end is None:
            break
        i = text.find("{", end)
    return spans


@dataclass
class _PartialCall:
    name: str | None
    args_prefix: str  # argument text written so far (a prefix of the final arguments)
    complete: ToolCall | None  # set once the object is whole and valid


def _read_call(text: str, start: int, end: int | None) -> _PartialCall:
    obj = text[start:end] if end is not None else text[start:]
    head = _HEAD.match(obj)
    name = json.loads(f'"{head.group(1)}"') if head else None
    args_prefix = ""
    if head and obj[head.end() : head.end() + 1] == "{":
        args_end = _value_end(obj, head.end())
        args_prefix = obj[head.end() : args_end] if args_end else obj[head.end() :]
    complete = None
    if end is not None:
        try:
            value = json.loads(obj)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            args = value.get("arguments", value.get("parameters", {}))
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    args = None
            if isinstance(args, dict):
                raw = args_prefix if head and _is_json(args_prefix) else None
                complete = ToolCall(value["name"], raw or json.dumps(args, ensure_ascii=False))
                name = value["name"]
    return _PartialCall(name, args_prefix, complete)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class ToolCallParser:
    """Finds tool calls in one format (see the module docstring)."""

    def __init__(self, name: str) -> None:
        if name not in PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; choose one of {PARSERS}")
        self.name = name
        self.markers = _MARKERS[name]

    def region(self, text: str) -> int | None:
        """Index where the tool calls begin, or None while the text is plain content."""
        if self.name == "json":
            return 0
        found = [i for i in (text.find(m) for m in self.markers) if i != -1]
        if found:
            return min(found)
        if self.name == "llama3" and text.lstrip().startswith("{"):
            return len(text) - len(text.lstrip())
        return None

    def held_back(self, text: str) -> int:
        """How many trailing characters may still turn into the start of a call."""
        if self.name == "llama3" and not text.strip():
            return len(text)
        longest = 0
        for marker in self.markers:
            for k in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:k]):
                    longest = max(longest, k)
                    break
        return longest

    def partial_calls(self, text: str) -> list[_PartialCall]:
        start = self.region(text)
        if start is None:
            return []
        return [_read_call(text, s, e) for s, e in _objects(text, start)]

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content before the calls, calls) of a finished output. Output whose calls do not
        parse is returned whole as content, with no calls."""
        start = self.region(text)
        if start is None:
            return text, []
        calls = [c.complete for c in self.partial_calls(text)]
        if not calls or any(c is None for c in calls):
            return text, []
        content = text[:start].strip()
        return content or None, calls  # type: ignore[return-value]


class ToolCallStreamer:
    """Turns one choice's growing output into OpenAI deltas: content until the calls begin,
    then per call its id and name first and its argument text as it grows."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.sent_content = 0
        self.ids: list[str] = []
        self.sent_args: list[int] = []
        self.emitted_calls = False

    def update(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool_call deltas) for the cumulative text."""
        start = self.parser.region(text)
        if start is None:
            end = len(text) if finished else len(text) - self.parser.held_back(text)
            return self._content_to(text, end), []
        content = self._content_to(text, start)
        deltas: list[dict[str, Any]] = []
        partials = self.parser.partial_calls(text)
        for k, call in enumerate(partials):
            if call.name is None:
                break  # later calls wait for this one's name
            if k == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_args.append(0)
                deltas.append(
                    {
                        "index": k,
                        "id": self.ids[k],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            args = call.complete.arguments if call.complete else call.args_prefix
            if len(args) > self.sent_args[k] and (call.complete or not finished):
                deltas.append({"index": k, "function": {"arguments": args[self.sent_args[k] :]}})
                self.sent_args[k] = len(args)
        if deltas:
            self.emitted_calls = True
        if finished and not self.emitted_calls:
            content += self._content_to(text, len(text))  # calls did not parse: plain text
        return content, deltas

    def _content_to(self, text: str, end: int) -> str:
        if end <= self.sent_content:
            return ""
        delta = text[self.sent_content : end]
        self.sent_content = end
        return delta
