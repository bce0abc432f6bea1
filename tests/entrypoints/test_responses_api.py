"""OpenAI's Responses API through the official `openai` client against a real `genserve serve`
on the embedded SmolLM2-135M-Instruct (greedy, so answers are fixed): string and item input,
the streamed event sequence, function-tool round trips, structured output, conversations
continued with `previous_response_id`, the store (retrieve, delete, `store: false`) and
errors in OpenAI's envelope."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import SMOL_API_KEY

pytestmark = pytest.mark.slow

ASK = "What is the capital of France?"
SYSTEM = "You are a helpful assistant."
AUTH = {"Authorization": f"Bearer {SMOL_API_KEY}"}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(smol_api_server: str) -> str:
    return smol_api_server  # the session's SmolLM2 server, --api-key SMOL_API_KEY


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server + "/v1/models", headers=AUTH).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=SMOL_API_KEY, max_retries=0,
                         timeout=120)


def _chat(client, model, messages, max_tokens):
    return client.chat.completions.create(model=model, messages=messages, temperature=0,
                                          max_tokens=max_tokens)


def test_string_input(client, model):
    resp = client.responses.create(model=model, input=ASK, temperature=0, max_output_tokens=40)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status == "completed" and resp.incomplete_details is None
    assert [item.type for item in resp.output] == ["message"]
    assert resp.output[0].content[0].type == "output_text"
    assert "Paris" in resp.output_text
    assert resp.usage.input_tokens > 5 and 0 < resp.usage.output_tokens <= 40
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens


def test_instructions_and_items_equal_chat_completions(client, model):
    resp = client.responses.create(
        model=model, instructions=SYSTEM, temperature=0, max_output_tokens=30,
        input=[{"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": ASK}]}])
    chat = _chat(client, model, [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": ASK}], 30)
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens


def test_length_limited_is_incomplete(client, model):
    resp = client.responses.create(model=model, input=ASK, temperature=0, max_output_tokens=3)
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.output[0].status == "incomplete"


def test_stream_events_in_order_equal_the_full_text(client, model):
    full = client.responses.create(model=model, input=ASK, temperature=0, max_output_tokens=30)
    events = list(client.responses.create(model=model, input=ASK, temperature=0,
                                          max_output_tokens=30, stream=True))
    names = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert names[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 3 and set(names[4:-4]) == {"response.output_text.delta"}
    final = events[-1].response
    assert "".join(deltas) == events[-4].text == final.output_text == full.output_text
    assert final.usage.output_tokens == full.usage.output_tokens
    assert events[0].response.status == "in_progress" and final.status == "completed"
    item_ids = {getattr(e, "item_id", None) for e in events[3:-2]}
    assert item_ids == {final.output[0].id}


def test_function_tool_round_trip(client, model):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    resp = client.responses.create(model=model, input=ask, tools=[WEATHER],
                                   tool_choice="required", temperature=0, max_output_tokens=60)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_")
    args = json.loads(calls[0].arguments)
    assert isinstance(args["city"], str) and set(args) == {"city"}
    # The named form, streamed: the arguments arrive as deltas and equal the full call's.
    events = list(client.responses.create(
        model=model, input=ask, tools=[WEATHER], temperature=0, max_output_tokens=60,
        tool_choice={"type": "function", "name": "get_weather"}, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and "".join(deltas) == done[0].arguments
    assert json.loads(done[0].arguments) == args
    assert events[-1].type == "response.completed"
    streamed = [i for i in events[-1].response.output if i.type == "function_call"]
    assert streamed[0].arguments == done[0].arguments
    # The result goes back as a function_call_output item; the model answers in text.
    follow = client.responses.create(
        model=model, tools=[WEATHER], temperature=0, max_output_tokens=8,
        input=[*ask, *resp.output, {"type": "function_call_output",
                                    "call_id": calls[0].call_id, "output": "Sunny, 24 degrees"}])
    assert follow.output[0].type == "message" and follow.output_text
    assert follow.usage.input_tokens > resp.usage.input_tokens


def test_json_schema_output(client, model):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"], "additionalProperties": False}
    resp = client.responses.create(
        model=model, input="Ann is 30. Give her as JSON.", temperature=0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "person", "schema": person,
                         "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), person)
    assert resp.text.format.type == "json_schema"


def test_previous_response_id_continues_the_conversation(client, model):
    first = client.responses.create(model=model, input="My name is Ann.", temperature=0,
                                    max_output_tokens=8)
    second = client.responses.create(model=model, input="What is my name?", temperature=0,
                                     max_output_tokens=8, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    chat = _chat(client, model, [{"role": "user", "content": "My name is Ann."},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": "What is my name?"}], 8)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.output_text == chat.choices[0].message.content


def test_retrieve_delete_and_store_false(server, client, model):
    resp = client.responses.create(model=model, input=ASK, temperature=0, max_output_tokens=8)
    again = client.responses.retrieve(resp.id)
    assert again.id == resp.id and again.output_text == resp.output_text
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(resp.id)
    assert err.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(resp.id)
    unstored = client.responses.create(model=model, input=ASK, temperature=0,
                                       max_output_tokens=8, store=False)
    assert unstored.store is False and unstored.output_text == resp.output_text
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=model, input="And Spain?", max_output_tokens=8,
                                previous_response_id=unstored.id)
    assert err.value.body["type"] == "not_found_error"
    assert err.value.body["param"] == "previous_response_id"
    assert httpx.get(f"{server}/v1/responses/{unstored.id}", headers=AUTH).status_code == 404


def test_bad_input_in_openai_envelope(server, client, model):
    def post(body):
        r = httpx.post(server + "/v1/responses", json=body, headers=AUTH, timeout=60)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        return r

    r = post({"model": model})
    assert r.status_code == 400 and "input" in r.json()["error"]["message"]
    r = post({"model": model, "input": "hi", "tools": [{"type": "web_search_preview"}]})
    assert r.status_code == 400 and "web_search_preview" in r.json()["error"]["message"]
    # The image_generation tool on a server without a diffusion model (--no-diffusion).
    r = post({"model": model, "input": "a red circle", "tools": [{"type": "image_generation"}]})
    assert r.status_code == 400 and "no diffusion model" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "image_generation_not_available"
    r = post({"model": model, "input": [{"type": "computer_call_output", "call_id": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0"
    r = post({"model": model, "input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404
    r = post({"model": model, "input": "hi", "tool_choice": "required"})
    assert r.status_code == 400 and "tool" in r.json()["error"]["message"]
    r = post({"model": "no-such-model", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=model, input="hi", max_output_tokens=0)
    # Unknown fields are tolerated, and the server keeps serving.
    resp = client.responses.create(model=model, input=ASK, temperature=0, max_output_tokens=4,
                                   extra_body={"some_future_field": {"x": 1}})
    assert resp.status == "incomplete" and resp.output_text
