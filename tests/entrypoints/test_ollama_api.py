"""The Ollama API through the official `ollama` client against a real `genserve serve` on the
embedded SmolLM2-135M-Instruct (greedy): chat and generate, NDJSON streaming equal to the
non-streamed answer, options, JSON format, tool calls, the model listings, and errors as
Ollama sends them, with the API key enforced."""

from __future__ import annotations

import base64
import io
import json

import httpx
import jsonschema
import ollama
import pytest
from PIL import Image

from tests.entrypoints.conftest import SMOL_API_KEY

pytestmark = pytest.mark.slow

KEY = SMOL_API_KEY
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 30}
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(smol_api_server: str) -> str:
    return smol_api_server  # the session's SmolLM2 server, --api-key KEY


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server, headers=AUTH, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.list().models[0].model


def test_listings(client, model, server):
    shown = client.show(model)
    assert "completion" in shown.capabilities and "vision" not in shown.capabilities
    assert [m.model for m in client.ps().models] == [model]
    assert httpx.get(server + "/api/version", headers=AUTH).json()["version"]
    assert client.show(model + ":latest").capabilities == shown.capabilities


def test_chat_greedy_and_stream_equal(client, model):
    full = client.chat(model=model, messages=ASK, stream=False, options=GREEDY)
    assert "Paris" in full.message.content and full.done and full.done_reason in ("stop",
                                                                                  "length")
    assert full.prompt_eval_count > 5 and 0 < full.eval_count <= 30
    assert full.total_duration >= full.eval_duration > 0
    parts = list(client.chat(model=model, messages=ASK, options=GREEDY, stream=True))
    assert len(parts) > 2 and parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == full.message.content
    assert parts[-1].eval_count == full.eval_count
    # Without `stream` the server streams NDJSON, as Ollama does (the client always sends it).
    r = httpx.post(client._client.base_url.join("/api/chat"), headers=AUTH, timeout=120,
                   json={"model": model, "messages": ASK, "options": GREEDY})
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert r.headers["content-type"] == "application/x-ndjson" and len(lines) == len(parts)
    assert "".join(x["message"]["content"] for x in lines) == full.message.content


def test_generate_options(client, model):
    full = client.generate(model=model, prompt="What is the capital of France?",
                           options=GREEDY)
    assert "Paris" in full.response
    streamed = "".join(p.response for p in client.generate(
        model=model, prompt="What is the capital of France?", options=GREEDY, stream=True))
    assert streamed == full.response
    short = client.generate(model=model, prompt="What is the capital of France?",
                            options={"temperature": 0, "num_predict": 3})
    assert short.done_reason == "length" and short.eval_count == 3
    word = full.response.split()[2]
    cut = client.generate(model=model, prompt="What is the capital of France?",
                          options={**GREEDY, "stop": [word]})
    assert word not in cut.response and full.response.startswith(cut.response)
    seeded = [client.generate(model=model, prompt="Tell me a story.",
                              options={"seed": 7, "temperature": 1, "num_predict": 12}).response
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_json_format(client, model):
    ask = [{"role": "user", "content": "Give a JSON object with keys name and age for a "
                                       "person named Ann aged 30."}]
    loose = client.chat(model=model, messages=ask, format="json",
                        options={"temperature": 0, "num_predict": 100})
    assert isinstance(json.loads(loose.message.content), dict)
    strict = client.chat(model=model, messages=ask, format=PERSON,
                         options={"temperature": 0, "num_predict": 100})
    jsonschema.validate(json.loads(strict.message.content), PERSON)


def test_tool_round_trip(client, model):
    """Ollama has no tool_choice and SmolLM2-135M does not write a valid call unforced, so
    this checks the request side: tools, the assistant's call and the tool's result all reach
    the prompt, and the model answers."""

    def get_weather(city: str) -> str:
        """Current weather in a city.

        Args:
          city: The city
        """
        return "Sunny"

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    # Only the prompts' lengths are compared: one new token each; a few for the answer.
    one = {"temperature": 0, "num_predict": 1}
    plain = client.chat(model=model, messages=ask, options=one)
    first = client.chat(model=model, messages=ask, tools=[get_weather], options=one)
    assert first.prompt_eval_count > plain.prompt_eval_count + 20  # the tools were rendered
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    result = {"role": "tool", "content": "Sunny, 24 degrees", "tool_name": "get_weather"}
    follow = client.chat(model=model, messages=[*ask, call, result], tools=[get_weather],
                         options={"temperature": 0, "num_predict": 8})
    assert follow.message.content
    assert follow.prompt_eval_count > first.prompt_eval_count + 10


def test_errors_as_ollama_sends_them(client, server, model):
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="no-such-model", messages=ASK, stream=False)
    assert err.value.status_code == 404 and "no-such-model" in err.value.error
    png = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(png, format="PNG")
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=model, stream=False, messages=[
            {"role": "user", "content": "What is this?", "images": [png.getvalue()]}])
    assert err.value.status_code == 400 and "image" in err.value.error
    r = httpx.post(server + "/api/chat", headers=AUTH, json={"model": model, "messages": 3})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.post(server + "/api/generate", json={"model": model, "prompt": "hi"})
    assert r.status_code == 401 and set(r.json()) == {"error"}
    no_key = ollama.Client(host=server)
    with pytest.raises(ollama.ResponseError) as err:
        no_key.list()
    assert err.value.status_code == 401
    b64 = base64.b64encode(png.getvalue()).decode()
    r = httpx.post(server + "/api/generate", headers=AUTH, json={
        "model": model, "prompt": "hi", "images": [b64], "stream": False})
    assert r.status_code == 400 and "image" in r.json()["error"]
    assert client.generate(model=model, prompt="hi", options={"num_predict": 2}).done
