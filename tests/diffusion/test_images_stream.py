"""Streamed image progress on /v1/images/generations and /v1/images/edits (real uvicorn, the
embedded tiny-flux): the official `openai` client reads OpenAI's partial-image and completed
events; the partial images are the denoising previews; the final image is byte for byte the
non-streamed one of the same seed."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from genserve.entrypoints.images.streaming import partial_steps
from tests.diffusion.helpers import error_of

STEPS = {"num_inference_steps": 4, "seed": 7}


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def _pixels(b64: str) -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return np.asarray(image.convert("RGB"), dtype=float)


def _png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, format="PNG")
    return buf.getvalue()


def test_partial_steps_spread_over_the_steps_before_the_last():
    assert partial_steps(8, 3) == {2, 4, 6}
    assert partial_steps(4, 2) == {1, 3}
    assert partial_steps(2, 3) == {1}  # fewer steps than partial images asked for
    assert partial_steps(1, 2) == set() and partial_steps(8, 0) == set()


def test_generation_streams_partial_images_then_the_same_final_image(client):
    full = client.images.generate(model="tiny-flux", prompt="a red cat", size="32x32",
                                  extra_body=STEPS)
    events = list(client.images.generate(model="tiny-flux", prompt="a red cat", size="32x32",
                                         stream=True, partial_images=2, extra_body=STEPS))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + [
        "image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    final = events[-1]
    assert final.b64_json == full.data[0].b64_json  # byte-identical to the non-streamed one
    assert final.size == "32x32" and final.output_format == "png" and final.usage is not None
    previews = [_pixels(e.b64_json) for e in events[:2]]
    assert all(p.shape == (32, 32, 3) for p in previews)
    # Previews of the denoising: they change as it goes, and none is the final picture.
    assert not np.array_equal(previews[0], previews[1])
    assert all(not np.array_equal(p, _pixels(final.b64_json)) for p in previews)
    # Without partial images only the final image comes.
    only = list(client.images.generate(model="tiny-flux", prompt="a red cat", size="32x32",
                                       stream=True, extra_body=STEPS))
    assert [e.type for e in only] == ["image_generation.completed"]
    assert only[0].b64_json == full.data[0].b64_json


def test_edit_streams_in_the_image_edit_events(client):
    fields = {"num_inference_steps": 4, "seed": 1, "strength": 0.5}
    full = client.images.edit(model="tiny-flux", prompt="a cat",
                              image=("in.png", _png((255, 0, 0)), "image/png"),
                              extra_body=fields)
    events = list(client.images.edit(model="tiny-flux", prompt="a cat",
                                     image=("in.png", _png((255, 0, 0)), "image/png"),
                                     stream=True, partial_images=1, extra_body=fields))
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    assert events[-1].b64_json == full.data[0].b64_json
    assert _pixels(events[0].b64_json).shape == (32, 32, 3)


def test_bad_streamed_requests_are_http_errors(http):
    body = {"model": "tiny-flux", "prompt": "a cat", "size": "32x32", "stream": True}
    r = http.post("/v1/images/generations", json={**body, "n": 2})
    assert r.status_code == 400 and "n=1" in error_of(r)["message"]
    # Found by the engine's checks: still an HTTP status, before any event.
    r = http.post("/v1/images/generations", json={**body, "size": "40x32"})
    assert r.status_code == 400 and "multiple of 16" in error_of(r)["message"]
    r = http.post("/v1/images/generations", json={**body, "partial_images": 4})
    assert r.status_code == 400 and "partial_images" in error_of(r)["message"]
    r = http.post("/v1/images/generations", json={**body, "num_inference_steps": 2,
                                                  "partial_images": 1})
    assert r.status_code == 200 and r.text.count("event: ") == 2
