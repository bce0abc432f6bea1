"""Image inputs through the Anthropic and Ollama official clients to the `shapes-vl` demo
vision model on a real `genserve serve`: base64 pictures (Anthropic image blocks, Ollama
`images`) are described correctly, as through the chat endpoint."""

from __future__ import annotations

import base64
import io

import ollama
import pytest

from genserve.demo_models import world
from tests.needs import imported_on_use

anthropic = imported_on_use("anthropic")  # the official client, imported by the tests that run

pytestmark = pytest.mark.slow

SCENE = world.Scene("blue", "triangle", "gray", position="bottom right")


def png_b64(scene: world.Scene) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(world.render_image(scene)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def server(default_models_server: str) -> str:
    return default_models_server  # the session's default server: shapes-vl beside SmolLM2


def test_anthropic_image_block(server):
    client = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=120)
    msg = client.messages.create(
        model="shapes-vl", max_tokens=32, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": png_b64(SCENE)}},
            {"type": "text", "text": "Describe the image."}]}])
    assert msg.content[0].text == SCENE.prompt() and msg.stop_reason == "end_turn"


def test_ollama_images(server):
    client = ollama.Client(host=server, timeout=120)
    assert "vision" in client.show("shapes-vl").capabilities
    reply = client.chat(model="shapes-vl", options={"temperature": 0, "num_predict": 32},
                        messages=[{"role": "user", "content": "Describe the image.",
                                   "images": [png_b64(SCENE)]}])
    assert reply.message.content == SCENE.prompt()
    generated = client.generate(model="shapes-vl", prompt="Describe the image.",
                                images=[png_b64(SCENE)],
                                options={"temperature": 0, "num_predict": 32})
    assert generated.response == SCENE.prompt()
