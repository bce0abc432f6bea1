"""How the Anthropic and Ollama families write a finished output (no engine): tool calls in
the hermes format the model writes become `tool_use` blocks / Ollama `tool_calls`, stop
reasons map to each protocol's names, and requests translate into the chat request they mean.
SmolLM2 does not write a valid call unforced, so the real-server tests cannot reach this."""

from __future__ import annotations

import pytest

from genserve.entrypoints.anthropic_api.protocol import MessagesRequest
from genserve.entrypoints.anthropic_api.serving import _full, _stop
from genserve.entrypoints.anthropic_api.translate import to_chat
from genserve.entrypoints.errors import APIError, body_for_path
from genserve.entrypoints.ollama_api.protocol import ChatRequest
from genserve.entrypoints.ollama_api.serving import _done_reason, _split
from genserve.entrypoints.ollama_api.translate import chat_to_chat, served_name
from genserve.entrypoints.openai_api.serving_chat import PreparedChat
from genserve.entrypoints.openai_api.tool_calls import ToolCallParser
from genserve.entrypoints.openai_api.tools import ToolPlan
from genserve.srt.messages import GenerateOutput

CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
       '</tool_call>'


def output(text: str, kind: str = "stop", matched: object = None) -> GenerateOutput:
    return GenerateOutput(rid="r", text=text, output_ids=[], finished=True,
                          finish_reason={"type": kind, "matched": matched}, prompt_tokens=7,
                          completion_tokens=5, cached_tokens=0, e2e_latency=0.0)


def prepared(tools: bool) -> PreparedChat:
    plan = ToolPlan([], True, ToolCallParser("hermes"), {}) if tools else None
    return PreparedChat(client=None, prompt_ids=[1] * 7, reqs=[], plan=plan,  # type: ignore
                        reasoning=None)


def test_anthropic_tool_use_block_and_stop_reasons():
    body = MessagesRequest(model="m", max_tokens=9, stop_sequences=["END"],
                           messages=[{"role": "user", "content": "hi"}])
    msg = _full(body, prepared(True), "msg_1", output(CALL))
    assert [b["type"] for b in msg["content"]] == ["text", "tool_use"]
    assert msg["content"][0]["text"] == "Let me check."
    assert msg["content"][1]["name"] == "get_weather"
    assert msg["content"][1]["input"] == {"city": "Paris"}
    assert msg["content"][1]["id"].startswith("toolu_") and msg["stop_reason"] == "tool_use"
    assert msg["usage"] == {"input_tokens": 7, "output_tokens": 5}
    assert _stop(output("x", "length"), False, None) == ("max_tokens", None)
    assert _stop(output("x", "stop", "END"), False, ["END"]) == ("stop_sequence", "END")
    assert _stop(output("x", "stop", 2), False, ["END"]) == ("end_turn", None)
    plain = _full(body, prepared(False), "msg_2", output(CALL))
    assert plain["content"] == [{"type": "text", "text": CALL}]


def test_anthropic_translation():
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                               "name": "get_weather", "input": {"city": "P"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "Sunny"}]}]}]})
    chat = to_chat(body)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[2].tool_calls[0]["function"]["arguments"] == '{"city": "P"}'
    assert chat.messages[3].tool_call_id == "t1" and chat.messages[3].content == "Sunny"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.max_tokens == 9


def test_ollama_tool_calls_and_translation():
    thought, text, calls = _split(prepared(True), CALL)
    assert thought is None and text == "Let me check."
    assert calls == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert _done_reason(output("x", "length")) == "length"
    assert _done_reason(output("x")) == "stop"
    chat = chat_to_chat(ChatRequest.model_validate({
        "model": "m", "format": {"type": "object"},
        "options": {"num_predict": -1, "temperature": 0.5, "repeat_penalty": 1.1, "seed": 3},
        "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}), "m")
    assert chat.max_tokens is None and chat.temperature == 0.5 and chat.seed == 3
    assert chat.repetition_penalty == 1.1 and chat.stream is True
    assert chat.response_format.json_schema == {"name": "format", "schema": {"type": "object"}}
    assert chat.messages[0].content[0].image_url.url == "aGk="
    assert served_name("m:latest", ["m"]) == "m" and served_name("x:latest", ["m"]) == "x:latest"
    with pytest.raises(APIError):
        chat_to_chat(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                 options={"num_predict": 0}), "m")


def test_error_envelopes_by_path():
    err = APIError(404, "nope")
    assert body_for_path("/v1/messages", err) == {
        "type": "error", "error": {"type": "not_found_error", "message": "nope"}}
    assert body_for_path("/v1/messages/count_tokens", APIError(503, "busy"))["error"][
        "type"] == "overloaded_error"
    assert body_for_path("/api/chat", err) == {"error": "nope"}
    assert body_for_path("/v1/chat/completions", err)["error"]["message"] == "nope"
    assert body_for_path("/v1/messagesX", err) == err.body()


def test_reasoning_becomes_thinking_block_and_field():
    from genserve.entrypoints.openai_api.reasoning import ReasoningParser

    prep = prepared(False)
    prep.reasoning = ReasoningParser("qwen3")
    body = MessagesRequest(model="m", max_tokens=9, messages=[{"role": "user", "content": "x"}])
    msg = _full(body, prep, "msg_3", output("<think>Hmm.</think>Paris."))
    assert msg["content"][0] == {"type": "thinking", "thinking": "Hmm.", "signature": ""}
    assert msg["content"][1] == {"type": "text", "text": "Paris."}
    assert _split(prep, "<think>Hmm.</think>Paris.")[:2] == ("Hmm.", "Paris.")
