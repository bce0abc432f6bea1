"""The Responses API's output builder on scripted outputs (no engine): reasoning items when a
reasoning parser is set, text, function calls, the event order, and the same items whether
the text arrives at once (non-streamed) or piece by piece (streamed)."""

from __future__ import annotations

import json

from genserve.entrypoints.openai_api.reasoning import ReasoningParser
from genserve.entrypoints.openai_api.tool_calls import ToolCallParser
from genserve.entrypoints.responses_api.output import OutputBuilder
from genserve.srt.messages import GenerateOutput


def _out(text: str, finished: bool, reason: str = "stop") -> GenerateOutput:
    return GenerateOutput(rid="r", text=text, output_ids=[], finished=finished,
                          finish_reason={"type": reason} if finished else None,
                          prompt_tokens=4, completion_tokens=len(text), cached_tokens=0,
                          e2e_latency=0.0)


def _run(builder: OutputBuilder, text: str, step: int, reason: str = "stop"
         ) -> list[dict]:
    events = []
    for end in range(step, len(text), step):
        events += builder.update(_out(text[:end], False))
    events += builder.update(_out(text, True, reason))
    return events


def _strip_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_reasoning_then_message():
    text = "<think>Paris is in France.</think>The capital is Paris."
    streamed = OutputBuilder(ReasoningParser("qwen3"), None)
    events = _run(streamed, text, 3)
    whole = OutputBuilder(ReasoningParser("qwen3"), None)
    whole.update(_out(text, True))
    assert _strip_ids(streamed.items) == _strip_ids(whole.items)
    reasoning, message = streamed.items
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Paris is in France."}]
    assert message["content"][0]["text"] == "The capital is Paris."
    names = [e["type"] for e in events]
    assert names[:2] == ["response.output_item.added", "response.content_part.added"]
    first_message = names.index("response.output_text.delta")
    assert names[first_message - 5:first_message] == [
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added",
        "response.content_part.added"]
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (thought, answer) == ("Paris is in France.", "The capital is Paris.")
    assert [e["output_index"] for e in events if e["type"].endswith(".delta")] == \
        [0] * names.count("response.reasoning_text.delta") + \
        [1] * names.count("response.output_text.delta")


def test_function_calls_after_blank_text():
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    text = f"\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
    streamed = OutputBuilder(None, ToolCallParser("hermes"))
    events = _run(streamed, text, 4)
    assert [i["type"] for i in streamed.items] == ["function_call"]  # the blank is dropped
    item = streamed.items[0]
    assert item["name"] == "get_weather" and json.loads(item["arguments"]) == {"city": "Paris"}
    deltas = "".join(e["delta"] for e in events
                     if e["type"] == "response.function_call_arguments.delta")
    assert deltas == item["arguments"]
    assert [e["type"] for e in events][-2:] == ["response.function_call_arguments.done",
                                                "response.output_item.done"]
    whole = OutputBuilder(None, ToolCallParser("hermes"))
    whole.update(_out(text, True))
    assert _strip_ids(whole.items) == _strip_ids(streamed.items)


def test_cut_off_message_is_incomplete_and_empty_output_is_one_message():
    cut = OutputBuilder(None, None)
    _run(cut, "The capital", 2, reason="length")
    assert [(i["type"], i["status"]) for i in cut.items] == [("message", "incomplete")]
    assert cut.items[0]["content"][0]["text"] == "The capital"
    empty = OutputBuilder(None, None)
    events = empty.update(_out("", True))
    assert [i["content"][0]["text"] for i in empty.items] == [""]
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done"]
