"""Anthropic's Messages API through the official `anthropic` client against a real
`genserve serve` on the embedded SmolLM2-135M-Instruct (greedy, so answers are fixed): text,
the streamed event sequence, stop reasons, tool-use round trips and errors in Anthropic's
envelope, with the API key enforced."""

from __future__ import annotations

import base64
import io
import json

import httpx
import jsonschema
import pytest
from PIL import Image

from tests.entrypoints.conftest import SMOL_API_KEY
from tests.needs import imported_on_use

anthropic = imported_on_use("anthropic")  # the official client, imported by the tests that run

pytestmark = pytest.mark.slow

KEY = SMOL_API_KEY
# This client has no `temperature` argument (the API still takes the field): sent as extra body.
GREEDY = {"extra_body": {"temperature": 0}}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 30}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(smol_api_server: str) -> str:
    return smol_api_server  # the session's SmolLM2 server, --api-key KEY


@pytest.fixture(scope="module")
def model(server) -> str:
    cards = httpx.get(server + "/v1/models", headers={"x-api-key": KEY}).json()["data"]
    return cards[0]["id"]


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)


def test_greedy_answer_and_usage(client, model):
    msg = client.messages.create(model=model, max_tokens=40, messages=ASK, **GREEDY,
                                 system="You are a helpful assistant.")
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "text" and "Paris" in msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens > 5 and 0 < msg.usage.output_tokens <= 40
    counted = client.messages.count_tokens(model=model, messages=ASK,
                                           system="You are a helpful assistant.")
    assert counted.input_tokens == msg.usage.input_tokens


def test_stream_events_in_order_equal_the_full_text(server, client, model):
    full = client.messages.create(model=model, max_tokens=30, messages=ASK, **GREEDY)
    with client.messages.stream(model=model, max_tokens=30, messages=ASK,
                                **GREEDY) as stream:
        deltas = [event.text for event in stream if event.type == "text"]
        final = stream.get_final_message()
    assert "".join(deltas) == final.content[0].text == full.content[0].text
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens
    # The wire order (the SDK hides `ping`).
    with httpx.stream("POST", server + "/v1/messages", headers={"x-api-key": KEY}, timeout=120,
                      json={"model": model, "max_tokens": 30, "messages": ASK, "stream": True,
                            "temperature": 0}) as r:
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"} and len(names) > 6


def test_max_tokens_and_stop_sequence(client, model):
    short = client.messages.create(model=model, max_tokens=3, messages=ASK, **GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    full = client.messages.create(model=model, max_tokens=30, messages=ASK, **GREEDY)
    word = full.content[0].text.split()[2]
    cut = client.messages.create(model=model, max_tokens=30, messages=ASK, **GREEDY,
                                 stop_sequences=[word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert word not in cut.content[0].text
    assert full.content[0].text.startswith(cut.content[0].text)


def test_tool_use_round_trip(client, model):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg = client.messages.create(model=model, max_tokens=60, messages=ask, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 **GREEDY)
    assert msg.stop_reason == "tool_use"
    use = next(b for b in msg.content if b.type == "tool_use")
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str)
    with client.messages.stream(model=model, max_tokens=60, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "any"}, **GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
    follow = client.messages.create(
        model=model, max_tokens=8, tools=[WEATHER], **GREEDY,
        messages=[*ask, {"role": "assistant", "content": msg.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "Sunny, 24 degrees"}]}])
    assert follow.content[0].type == "text" and follow.content[0].text


def test_structured_output(client, model):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"], "additionalProperties": False}
    msg = client.messages.create(
        model=model, max_tokens=60, **GREEDY,
        messages=[{"role": "user", "content": "Ann is 30. Give her as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": person}})
    jsonschema.validate(json.loads(msg.content[0].text), person)


def test_errors_in_anthropic_envelope(server, client, model):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=model, max_tokens=0, messages=ASK)
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(server + "/v1/messages", headers={"x-api-key": KEY},
                   json={"model": model, "messages": ASK})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="no-such-model", max_tokens=5, messages=ASK)
    assert err.value.body["error"]["type"] == "not_found_error"
    png = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(png, format="PNG")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png.getvalue()).decode()}}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=model, max_tokens=5, messages=[{"role": "user", "content": [
            image, {"type": "text", "text": "What is this?"}]}])
    assert "image" in err.value.body["error"]["message"]
    bad_key = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad_key.messages.create(model=model, max_tokens=5, messages=ASK)
    assert err.value.body["error"]["type"] == "authentication_error"
    # The server keeps serving.
    assert client.messages.create(model=model, max_tokens=2, messages=ASK).content
