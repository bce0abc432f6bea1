"""/v1/images over a real uvicorn server with the embedded tiny-flux model."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from tests.diffusion.helpers import error_of

FAST = {"model": "tiny-flux", "size": "32x32", "num_inference_steps": 2}


def generate(http, **kw):
    return http.post("/v1/images/generations", json={"prompt": "a red cat", **FAST, **kw})


def decode(item) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))


def test_models_lists_the_diffusion_models(http):
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert models["tiny-flux"]["kind"] == "diffusion"
    assert models["tiny-flux"]["task"] == "text-to-image"
    assert models["tiny-wan"]["task"] == "text-to-video"


@pytest.mark.parametrize("fmt, pil", [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_image_has_requested_size_and_format(http, fmt, pil):
    r = generate(http, size="48x32", output_format=fmt, seed=1)
    assert r.status_code == 200, r.text
    body = r.json()
    image = decode(body["data"][0])
    assert image.format == pil and image.size == (48, 32)
    assert body["size"] == "48x32" and body["output_format"] == fmt


def test_seed_reproducible_and_n_gives_distinct_images(http):
    a = generate(http, seed=123).json()["data"][0]["b64_json"]
    b = generate(http, seed=123).json()["data"][0]["b64_json"]
    c = generate(http, seed=124).json()["data"][0]["b64_json"]
    assert a == b and a != c
    two = generate(http, seed=123, n=2).json()["data"]
    assert len(two) == 2 and two[0]["b64_json"] != two[1]["b64_json"]
    assert two[0]["b64_json"] == a  # output 0 of n uses the request's seed


def test_url_response_and_content_endpoint(http):
    body = generate(http, seed=5, response_format="url", output_format="webp").json()
    item = body["data"][0]
    assert "b64_json" not in item and item["url"].endswith(f"/v1/images/{item['id']}/content")
    r = http.get(item["url"])
    assert r.status_code == 200 and r.headers["content-type"] == "image/webp"
    assert Image.open(io.BytesIO(r.content)).size == (32, 32)
    missing = http.get("/v1/images/img_doesnotexist/content")
    assert missing.status_code == 404 and "no image" in error_of(missing)["message"]


def test_default_model_and_step_cache_override(http):
    r = http.post("/v1/images/generations", json={
        "prompt": "a cat", "size": "32x32", "num_inference_steps": 8,
        "step_cache": {"residual_diff_threshold": 0.5}})
    body = r.json()
    assert r.status_code == 200 and body["model"] == "tiny-flux"
    assert body["cached_steps"] > 0 and body["num_inference_steps"] == 8
    off = generate(http, step_cache=False, num_inference_steps=8).json()
    assert off["cached_steps"] == 0


def test_openai_client_works_unchanged(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
    result = client.images.generate(model="tiny-flux", prompt="a cat", size="32x32", n=1,
                                    extra_body={"num_inference_steps": 2, "seed": 3})
    assert decode({"b64_json": result.data[0].b64_json}).size == (32, 32)
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, format="PNG")
    edited = client.images.edit(model="tiny-flux", image=("in.png", buf.getvalue(), "image/png"),
                                prompt="a cat", extra_body={"num_inference_steps": 2})
    assert decode({"b64_json": edited.data[0].b64_json}).size == (32, 32)


def png_bytes(color, size=(32, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_edit_follows_the_input_image(http):
    def edit(color, **fields):
        data = {"prompt": "a cat", "model": "tiny-flux", "num_inference_steps": "4",
                "strength": "0.3", "seed": "1", **fields}
        return http.post("/v1/images/edits", data=data,
                         files={"image": ("in.png", png_bytes(color), "image/png")})

    red, blue = edit((255, 0, 0)), edit((0, 0, 255))
    assert red.status_code == 200, red.text
    r = np.asarray(decode(red.json()["data"][0]), dtype=float)
    b = np.asarray(decode(blue.json()["data"][0]), dtype=float)
    assert r[..., 0].mean() > b[..., 0].mean() and r.shape == (32, 32, 3)
    bad = http.post("/v1/images/edits", data={"prompt": "a cat"},
                    files={"image": ("notes.txt", b"hello, not an image", "text/plain")})
    assert bad.status_code == 400 and "not an image" in error_of(bad)["message"]
    odd = http.post("/v1/images/edits", data={"prompt": "a cat"},
                    files={"image": ("in.png", png_bytes((1, 2, 3), (40, 40)), "image/png")})
    assert odd.status_code == 400 and "multiple of 16" in error_of(odd)["message"]
    none = http.post("/v1/images/edits", data={"prompt": "a cat"})
    assert none.status_code == 400 and "'image'" in error_of(none)["message"]


@pytest.mark.parametrize("kw, status, words", [
    (dict(size="40x32"), 400, ["width 40", "multiple of 16"]),
    (dict(size="1024x1024"), 400, ["over the cap"]),
    (dict(size="bigxsmall"), 400, ["WIDTHxHEIGHT"]),
    (dict(num_inference_steps=0), 400, ["num_inference_steps", "between 1"]),
    (dict(num_inference_steps="many"), 400, ["num_inference_steps"]),
    (dict(guidance_scale=1000), 400, ["guidance_scale"]),
    (dict(n=0), 400, ["'n'"]),
    (dict(output_format="gif"), 400, ["output_format"]),
    (dict(step_cache={"fn": 0}), 400, ["fn"]),
    (dict(model="no-such-model"), 404, ["no-such-model"]),
    (dict(model="tiny-wan"), 400, ["text-to-video", "/v1/videos"]),
    (dict(negative_prompt="blurry"), 400, ["negative_prompt"]),
    (dict(prompt=""), 400, ["prompt"]),
    (dict(colour="red"), 400, ["colour"]),
])
def test_bad_input_is_an_actionable_error(http, kw, status, words):
    r = generate(http, **kw)
    assert r.status_code == status, r.text
    message = error_of(r)["message"]
    for word in words:
        assert word in message, message


def test_image_store_keeps_content_consistent(server, http):
    from genserve.multimodal_gen.output_store import OutputStore

    item = generate(http, seed=9, response_format="url").json()["data"][0]
    store = OutputStore(server.output_dir / "images")  # re-reads what the server wrote
    store.check_integrity()
    path, media_type = store.get(item["id"])
    assert media_type == "image/png" and path.read_bytes() == http.get(item["url"]).content


def test_full_queue_is_503_at_once(http, server, diffusion_client):
    import threading
    import time

    import httpx

    long_done = []

    def long_request():
        with httpx.Client(base_url=server.url, timeout=60) as other:
            long_done.append(generate(other, size="64x64", num_inference_steps=40))

    thread = threading.Thread(target=long_request)
    saved = diffusion_client.max_queued
    diffusion_client.max_queued = 1
    try:
        thread.start()
        deadline = time.time() + 30
        while diffusion_client.queue_depth() == 0 and time.time() < deadline:
            time.sleep(0.005)
        r = generate(http)
        assert r.status_code == 503 and "queue is full" in error_of(r)["message"]
    finally:
        diffusion_client.max_queued = saved
        thread.join(timeout=60)
    assert long_done[0].status_code == 200
