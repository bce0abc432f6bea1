"""The output items of one response as its text grows, with the stream events that announce
them, in OpenAI's order:

    response.output_item.added      (reasoning, when a reasoning parser is set)
      response.content_part.added / response.reasoning_text.delta ... / .done / part done
    response.output_item.done
    response.output_item.added      (the assistant message)
      response.content_part.added / response.output_text.delta ... / .done / part done
    response.output_item.done
    response.output_item.added      (each function call)
      response.function_call_arguments.delta ... / .done
    response.output_item.done

A non-streamed response runs the same builder on the final output once and keeps only the
items, so both forms of a request carry the same output."""

from __future__ import annotations

import uuid
from typing import Any

from genserve.entrypoints.openai_api.reasoning import ReasoningParser, ReasoningStreamer
from genserve.entrypoints.openai_api.tool_calls import ToolCallParser, ToolCallStreamer
from genserve.srt.messages import GenerateOutput

Event = dict[str, Any]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def length_limited(out: GenerateOutput) -> bool:
    return (out.finish_reason or {}).get("type") == "length"


class OutputBuilder:
    """Feeds on the cumulative outputs of one generation (`update`); `items` holds the
    finished output items."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self.thinker = ReasoningStreamer(reasoning) if reasoning else None
        self.streamer = ToolCallStreamer(tools) if tools else None
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.text = ""  # the open item's text so far
        self.sent = 0  # characters of answer already taken (without a tool parser)
        self.blank = ""  # whitespace held back until text follows (dropped before a call)
        self.args: list[str] = []  # the arguments written so far, per call

    # -- items -----------------------------------------------------------------------------

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self.open = item
        self.text = ""
        return [{"type": "response.output_item.added", "output_index": len(self.items),
                 "item": item}]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _to(self, kind: str) -> list[Event]:
        """Open an item of `kind` ("reasoning" or "message") unless one is open."""
        if self.open is not None and self.open["type"] == kind:
            return []
        events = self._close(False)
        if kind == "reasoning":
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "content": [],
                    "status": "in_progress"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events += self._add(item)
        events.append({"type": "response.content_part.added", **self._where(),
                       "content_index": 0, "part": part})
        return events

    def _delta(self, text: str) -> list[Event]:
        assert self.open is not None
        self.text += text
        kind = ("response.reasoning_text.delta" if self.open["type"] == "reasoning"
                else "response.output_text.delta")
        event = {"type": kind, **self._where(), "content_index": 0, "delta": text}
        if self.open["type"] == "message":
            event["logprobs"] = []
        return [event]

    def _close(self, incomplete: bool) -> list[Event]:
        item = self.open
        if item is None:
            return []
        where = self._where()
        status = "incomplete" if incomplete else "completed"
        if item["type"] == "function_call":
            index = len(self.args) - 1
            item.update(arguments=self.args[index], status=status)
            events = [{"type": "response.function_call_arguments.done", **where,
                       "name": item["name"], "arguments": item["arguments"]}]
        else:
            if item["type"] == "reasoning":
                part = {"type": "reasoning_text", "text": self.text}
                done = {"type": "response.reasoning_text.done", **where, "content_index": 0,
                        "text": self.text}
            else:
                part = {"type": "output_text", "text": self.text, "annotations": [],
                        "logprobs": []}
                done = {"type": "response.output_text.done", **where, "content_index": 0,
                        "text": self.text, "logprobs": []}
            item.update(content=[part], status=status)
            events = [done, {"type": "response.content_part.done", **where, "content_index": 0,
                             "part": part}]
        events.append({"type": "response.output_item.done", **where, "item": item})
        self.items.append(item)
        self.open = None
        return events

    # -- text ------------------------------------------------------------------------------

    def _answer(self, text: str) -> list[Event]:
        if not text:
            return []
        if self.open is None or self.open["type"] != "message":
            if not text.strip():
                self.blank += text
                return []
            text, self.blank = self.blank + text, ""
        return self._to("message") + self._delta(text)

    def _calls(self, deltas: list[dict[str, Any]]) -> list[Event]:
        events: list[Event] = []
        for delta in deltas:
            fn = delta.get("function", {})
            if "id" in delta:  # a new call: its id and name come first
                events += self._close(False)
                self.args.append("")
                events += self._add({"id": _id("fc"), "type": "function_call",
                                     "call_id": delta["id"], "name": fn["name"],
                                     "arguments": "", "status": "in_progress"})
            piece = fn.get("arguments", "")
            if piece and "id" not in delta:
                self.args[-1] += piece
                events.append({"type": "response.function_call_arguments.delta",
                               **self._where(), "delta": piece})
        return events

    def update(self, out: GenerateOutput) -> list[Event]:
        """The events that the cumulative output `out` adds (the last one closes every
        item)."""
        text, thought = out.text, ""
        if self.thinker is not None:
            thought, text = self.thinker.update(out.text, out.finished)
        events: list[Event] = []
        if thought:
            events += self._to("reasoning") + self._delta(thought)
        if self.streamer is not None:
            content, calls = self.streamer.update(text, out.finished)
            events += self._answer(content) + self._calls(calls)
        else:
            events += self._answer(text[self.sent:])
            self.sent = max(self.sent, len(text))
        if out.finished:
            if not self.items and self.open is None:  # always at least one message
                events += self._to("message")
                if self.blank:
                    events += self._delta(self.blank)
            events += self._close(length_limited(out))
        return events
