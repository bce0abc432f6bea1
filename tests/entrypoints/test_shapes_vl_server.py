"""`genserve serve` with no model argument serves `shapes-vl` next to SmolLM2: /v1/models lists
it with image input, the official openai client sends it base64 pictures (streamed or not) and
it describes them correctly, and bad image inputs are 400s."""

from __future__ import annotations

import base64
import io

import httpx
import pytest

from genserve.demo_models import vl_data, world
from genserve.demo_models.vl_model import TOKENS_PER_IMAGE

pytestmark = pytest.mark.slow

SCENES = [
    world.Scene("blue", "triangle", "gray", position="bottom right"),
    world.Scene("yellow", "square", "black", position="top"),
]


def jpeg_url(scene: world.Scene, size: int = 96) -> str:
    """A held-out-style picture as a person would paste it: resized, saved as a JPEG."""
    from PIL import Image

    img = Image.fromarray(world.render_image(scene)).resize((size, size), Image.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def content(url: str, question: str) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]


@pytest.fixture(scope="module")
def server(default_models_server: str) -> str:
    return default_models_server  # the session's server started with no model argument


def test_served_by_default_with_image_input(server):
    cards = {m["id"]: m for m in httpx.get(server + "/v1/models").json()["data"]}
    assert cards["shapes-vl"]["modalities"] == ["text", "image"]
    assert cards["shapes-vl"]["kind"] == "llm"
    assert cards["SmolLM2-135M-Instruct"]["modalities"] == ["text"]


def test_openai_client_gets_correct_descriptions(server):
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="none")

    def ask(scene: world.Scene, question: str) -> str:
        r = client.chat.completions.create(
            model="shapes-vl",
            temperature=0,
            max_tokens=32,
            messages=[{"role": "user", "content": content(jpeg_url(scene), question)}],
        )
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    for scene in SCENES:
        assert ask(scene, "Describe the image.") == scene.prompt()
        for kind in ("colour", "shape", "position", "background"):
            assert ask(scene, vl_data.QUESTIONS[kind][0]) == vl_data.answer(scene, kind)
    # Streamed: the pieces add up to the sentence; the picture's tokens come from the cache.
    stream = client.chat.completions.create(
        model="shapes-vl",
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": content(jpeg_url(SCENES[0]), "Describe the image.")}],
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == SCENES[0].prompt()
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > TOKENS_PER_IMAGE


def _error(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err["message"]


def test_bad_image_inputs_are_400(server):
    def chat(model: str, parts: list[dict]) -> httpx.Response:
        return httpx.post(
            server + "/v1/chat/completions",
            timeout=60,
            json={
                "model": model,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": parts}],
            },
        )

    good = jpeg_url(SCENES[0], 32)
    garbage = "data:image/png;base64," + base64.b64encode(b"\x89PNG not really").decode()
    assert "cannot be decoded" in _error(chat("shapes-vl", content(garbage, "What is it?")))
    too_many = [{"type": "image_url", "image_url": {"url": good}}] * 17
    assert "at most 16" in _error(chat("shapes-vl", too_many))
    assert "does not take image inputs" in _error(
        chat("SmolLM2-135M-Instruct", content(good, "What is it?"))
    )
    assert chat("shapes-vl", content(good, "What shape is it?")).status_code == 200
    info = httpx.get(server + "/get_server_info").json()
    assert info.get("integrity_error") is None
