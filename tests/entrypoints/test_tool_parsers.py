"""Tool-call parsers on model-shaped text, whole and streamed character by character, and
genserve's own rendering of tools for templates that ignore them."""

from __future__ import annotations

import json

import httpx
import pytest

from genserve.entrypoints.openai_api.tool_calls import ToolCallParser, ToolCallStreamer
from genserve.entrypoints.openai_api.tools import detect_parser, own_tool_messages
from tests.entrypoints.gateway_fakes import FakeEngine

ARGS = '{"city": "Paris", "when": {"day": "mon}day"}, "tags": ["a", "b"]}'
CASES = {
    "hermes": (f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
               "</tool_call>", "Let me check."),
    "llama3": (f'{{"name": "get_weather", "parameters": {ARGS}}}; '
               '{"name": "get_time", "parameters": {"tz": "CET"}}', None),
    "mistral": (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}}}, '
                '{"name": "get_time", "arguments": {"tz": "CET"}}]', None),
    "json": (f'[{{"name": "get_weather", "arguments": {ARGS}}}, '
             '{"name": "get_time", "arguments": {"tz": "CET"}}]', None),
}


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_parse_whole_output(fmt):
    text, content = CASES[fmt]
    got_content, calls = ToolCallParser(fmt).parse(text)
    assert got_content == content
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == json.loads(ARGS)
    assert json.loads(calls[1].arguments) == {"tz": "CET"}
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_stream_char_by_char_rebuilds_the_calls(fmt):
    text, content = CASES[fmt]
    streamer = ToolCallStreamer(ToolCallParser(fmt))
    streamed_content, names, args, order = "", {}, {}, []
    for end in range(1, len(text) + 1):
        delta, calls = streamer.update(text[:end], end == len(text))
        streamed_content += delta
        for d in calls:
            k = d["index"]
            if "id" in d:
                assert k not in names and d["function"]["arguments"] == ""
                names[k] = d["function"]["name"]
                order.append(k)
            else:
                assert k in names  # the name always comes before argument text
                args[k] = args.get(k, "") + d["function"]["arguments"]
    assert streamed_content.strip() == (content or "")
    assert order == [0, 1] and names == {0: "get_weather", 1: "get_time"}
    assert json.loads(args[0]) == json.loads(ARGS) and json.loads(args[1]) == {"tz": "CET"}


def test_plain_text_and_broken_calls_stay_content():
    parser = ToolCallParser("hermes")
    assert parser.parse("Paris is sunny.") == ("Paris is sunny.", [])
    broken = '<tool_call>\n{"name": "f", "arguments": {"a": </tool_call>'
    assert parser.parse(broken) == (broken, [])
    # Streamed: a marker followed by no call is held back, then sent as text at the end.
    nameless = "<tool_call> I cannot call it."
    streamer = ToolCallStreamer(parser)
    out = "".join(streamer.update(nameless[:k], k == len(nameless))[0]
                  for k in range(1, len(nameless) + 1))
    assert out == nameless
    # A marker prefix at the end of a stream is held back until it is known to be text.
    streamer = ToolCallStreamer(parser)
    assert streamer.update("Hi <tool", False) == ("Hi ", [])
    assert streamer.update("Hi <tool>", True) == ("<tool>", [])


def test_detect_parser_from_rendered_template():
    assert detect_parser(None) == "hermes"
    assert detect_parser("<tools>...</tools> <tool_call>") == "hermes"
    assert detect_parser("[AVAILABLE_TOOLS] [...]") == "mistral"
    assert detect_parser("Environment: ipython\n...") == "llama3"


def test_own_rendering_of_tools_and_history():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = own_tool_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}], tools)
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.")
    assert '<tools>\n{"name": "f"' in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant",
                       "content": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}


def test_gateway_renders_tools_for_a_template_without_them(make_server):
    server = make_server(FakeEngine(context_length=2048))
    body = {"model": "fake-llm", "max_tokens": 3, "messages": [{"role": "user", "content": "q"}],
            "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {
                "type": "object", "properties": {"q": {"type": "string"}}}}}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "abc"}  # no call in the output
    prompt = "".join(map(chr, server.engine.requests[-1].input_ids))
    assert "<system>" in prompt and '"name": "lookup"' in prompt and "<tool_call>" in prompt
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "tool_choice": "none"})
    assert "lookup" not in "".join(map(chr, server.engine.requests[-1].input_ids))
    # Forcing a call needs constrained decoding, which the fake engine does not have.
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
