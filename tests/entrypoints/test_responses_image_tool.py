"""The built-in image_generation tool of /v1/responses on the real gateway with the fake engines
(no torch): when it runs, the item and OpenAI's stream events as the official `openai` client
parses them, partial images in order, the admission slot given back, and the 400s (bad options,
no diffusion model, tools it cannot tell apart, a picture sent to a model without image input).
The real models are in `test_responses_image_real.py`."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from genserve.multimodal_gen.messages import TEXT_TO_IMAGE, ModelSpec
from tests.entrypoints.gateway_fakes import FakeEngine
from tests.realtime.fake_diffusion import FAKE_VIDEO, FakeDiffusionClient
from tests.realtime.server import serve

pytestmark = pytest.mark.timeout(60)

FAKE_IMAGE = ModelSpec(name="fake-image", task=TEXT_TO_IMAGE, family="flux", size_factor=16,
                       max_pixels=256 * 256, default_width=32, default_height=32,
                       default_steps=6, default_guidance=1.0)
TOOL = {"type": "image_generation"}


class FakeImageClient(FakeDiffusionClient):
    def specs(self) -> list[ModelSpec]:
        return [FAKE_VIDEO, FAKE_IMAGE]


@pytest.fixture(scope="module")
def fake() -> FakeImageClient:
    return FakeImageClient(step_delay_s=0.01)


@pytest.fixture(scope="module")
def server(fake, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("GENSERVE_OUTPUT_DIR", str(tmp_path_factory.mktemp("out")))
    app = create_app(GatewayConfig(), [FakeEngine()], fake)
    with serve(app) as base:
        yield base, app.state.gateway
    mp.undo()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=30)


def _picture(b64: str, fmt: str = "PNG") -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == fmt
    return np.asarray(image.convert("RGB"))


def test_only_tool_runs_on_the_latest_user_text(client, fake, server):
    resp = client.responses.create(model="fake-llm", input="a red ball", tools=[TOOL])
    assert [item.type for item in resp.output] == ["image_generation_call"]
    call = resp.output[0]
    assert call.id.startswith("ig_") and call.status == "completed"
    assert call.revised_prompt == "a red ball" and call.size == "32x32"
    assert call.output_format == "png"
    assert _picture(call.result).shape == (32, 32, 3)
    assert fake.requests[-1].prompt == "a red ball" and fake.requests[-1].model == "fake-image"
    assert fake.requests[-1].preview is False  # no previews unless streamed partial images
    assert resp.usage.total_tokens == 0 and resp.status == "completed"
    assert client.responses.retrieve(resp.id).output[0].result == call.result
    assert server[1].in_flight.get("fake-image", 0) == 0
    server[1].admission.check_integrity()


def test_options_map_to_the_runtime(client, fake):
    resp = client.responses.create(
        model="fake-llm", input="a blue cube",
        tools=[{"type": "image_generation", "size": "64x48", "output_format": "jpeg",
                "output_compression": 50, "quality": "high", "seed": 7,
                "num_inference_steps": 3}],
        tool_choice={"type": "image_generation"})
    call = resp.output[0]
    assert call.size == "64x48" and call.output_format == "jpeg" and call.quality == "high"
    assert _picture(call.result, "JPEG").shape == (48, 64, 3)
    req = fake.requests[-1]
    assert (req.width, req.height, req.seed, req.num_inference_steps) == (64, 48, 7, 3)


def test_streamed_events_in_openai_order_with_partial_images(client, fake):
    tool = {"type": "image_generation", "partial_images": 3, "output_format": "webp"}
    events = list(client.responses.create(model="fake-llm", input="a green cone", tools=[tool],
                                          stream=True))
    names = [e.type for e in events]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.image_generation_call.in_progress",
                     "response.image_generation_call.generating",
                     *["response.image_generation_call.partial_image"] * 3,
                     "response.image_generation_call.completed", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    partials = [e for e in events if e.type.endswith("partial_image")]
    assert [p.partial_image_index for p in partials] == [0, 1, 2]
    item_id = events[2].item.id
    assert {e.item_id for e in events[3:-2]} == {item_id} and events[2].item.status == "in_progress"
    # Previews of increasing steps converge on the final picture (the fake's half-size previews).
    final = _picture(events[-2].item.result, "WEBP").astype(int)
    errors = [np.abs(_picture(p.partial_image_b64, "WEBP").astype(int) - final[::2, ::2]).mean()
              for p in partials]
    assert errors == sorted(errors, reverse=True) and errors[0] > errors[-1] + 5
    assert fake.requests[-1].preview is True
    done = events[-1].response
    assert done.output[0].result == events[-2].item.result and done.output[0].id == item_id


def test_tool_choice_none_or_a_function_leaves_it_to_the_model(client, fake):
    before = len(fake.requests)
    resp = client.responses.create(model="fake-llm", input="hi", tools=[TOOL],
                                   tool_choice="none", max_output_tokens=4)
    assert [item.type for item in resp.output] == ["message"] and resp.output_text == "abcd"
    assert len(fake.requests) == before


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize(("tool", "param", "words"), [
    ({"output_format": "gif"}, "tools.0.output_format", "gif"),
    ({"partial_images": 4}, "tools.0.partial_images", "less than or equal to 3"),
    ({"size": "big"}, "tools.0.size", "WIDTHxHEIGHT"),
    ({"size": "40x40"}, "tools.0", "multiple of 16"),  # the runtime's own check, before any event
    ({"background": "transparent"}, "tools.0.background", "transparent"),
    ({"action": "edit"}, "tools.0.action", "editing"),
    ({"model": "gpt-image-1"}, "tools.0.model", "fake-image"),
    ({"model": "fake-video"}, "tools.0.model", "not a served text-to-image model"),
    ({"quality": "ultra"}, "tools.0.quality", "quality"),
])
def test_bad_options_are_400(server, fake, tool, param, words):
    for stream in (False, True):
        r = httpx.post(server[0] + "/v1/responses", timeout=30, json={
            "model": "fake-llm", "input": "a ball", "stream": stream,
            "tools": [{"type": "image_generation", **tool}]})
        err = _error(r)
        assert err["param"] == param and words in err["message"], err
    assert server[1].in_flight.get("fake-image", 0) == 0


def test_unclear_requests_are_400(server):
    def post(**body):
        return _error(httpx.post(server[0] + "/v1/responses", timeout=30,
                                 json={"model": "fake-llm", "input": "a ball", **body}))

    fn = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    assert "picks one" in post(tools=[TOOL, fn])["message"]
    assert "holds no image_generation tool" in post(
        tools=[fn], tool_choice={"type": "image_generation"})["message"]
    assert "at most one" in post(tools=[TOOL, TOOL])["message"]
    err = post(tools=[TOOL], input=[{"role": "user", "content": [
        {"type": "input_text", "text": "like this"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    assert "cannot edit" in err["message"]
    assert _error(httpx.post(server[0] + "/v1/responses", timeout=30, json={
        "model": "nope", "input": "a ball", "tools": [TOOL]}), 404)["code"] == "model_not_found"


def test_a_picture_sent_to_a_model_without_image_input_is_400(client, server):
    drawn = client.responses.create(model="fake-llm", input="a red ball", tools=[TOOL])
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="fake-llm", input="What colour is it?",
                                previous_response_id=drawn.id)
    body = exc.value.body
    assert body["code"] == "image_input_not_supported" and "image_generation" in body["message"]
    # The item sent back as input is the same picture.
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="fake-llm", input=[
            drawn.output[0].model_dump(exclude_none=True),
            {"role": "user", "content": "What colour is it?"}])
    assert exc.value.body["code"] == "image_input_not_supported"


def test_no_diffusion_model_is_400(tmp_path, monkeypatch):
    monkeypatch.setenv("GENSERVE_OUTPUT_DIR", str(tmp_path))
    with serve(create_app(GatewayConfig(), [FakeEngine()], None)) as base:
        err = _error(httpx.post(base + "/v1/responses", timeout=30, json={
            "model": "fake-llm", "input": "a ball", "tools": [TOOL]}))
        assert err["code"] == "image_generation_not_available"
        assert "no diffusion model" in err["message"] and err["param"] == "tools.0"
        # Without the tool, the same request is an ordinary turn.
        r = httpx.post(base + "/v1/responses", timeout=30, json={
            "model": "fake-llm", "input": "a ball", "max_output_tokens": 3})
        assert r.status_code == 200 and r.json()["output"][0]["type"] == "message"
