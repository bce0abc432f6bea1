"""The image_generation tool of /v1/responses through the official `openai` client against a
real `genserve serve` with the demo models: shapes-image draws the prompt (the scorer reads the
colour back from the PNG), streamed partial images arrive in order before the same final
picture, and a follow-up question with `previous_response_id` is answered by shapes-vl, which
sees the picture through the image input path (its tokens cached on the second question)."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from genserve.demo_models import scorer, vl_data, world
from genserve.demo_models.vl_model import TOKENS_PER_IMAGE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# A held-out prompt shapes-vl reads correctly when shapes-image draws it at 128 px, seed 1
# (tests/realtime/test_chat_panel.py).
SCENE = world.held_out(False)[1]
TOOL = {"type": "image_generation", "size": "128x128", "seed": 1}


@pytest.fixture(scope="module")
def client(shapes_demo_server):
    """A client of the session's demo-model server (shapes-image is its text-to-image one)."""
    return openai.OpenAI(base_url=shapes_demo_server + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def _png(b64: str) -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return np.asarray(image.convert("RGB"))


def test_draws_the_prompt_and_the_vision_model_answers_about_it(client):
    drawn = client.responses.create(model="shapes-vl", input=SCENE.prompt(), tools=[TOOL])
    assert [item.type for item in drawn.output] == ["image_generation_call"]
    call = drawn.output[0]
    assert call.status == "completed" and call.revised_prompt == SCENE.prompt()
    picture = _png(call.result)
    assert picture.shape == (128, 128, 3)
    assert scorer.score_image(picture, SCENE)["colour"], scorer.read_image(picture)

    def ask(question: str) -> openai.types.responses.Response:
        return client.responses.create(model="shapes-vl", input=question, temperature=0,
                                       max_output_tokens=16, previous_response_id=drawn.id)

    colour = ask(vl_data.QUESTIONS["colour"][0])
    assert vl_data.parse_answer("colour", colour.output_text) == SCENE.colour, colour.output_text
    assert colour.usage.input_tokens > TOKENS_PER_IMAGE  # the picture is in the prompt
    shape = ask(vl_data.QUESTIONS["shape"][0])
    assert vl_data.parse_answer("shape", shape.output_text) == SCENE.shape, shape.output_text
    # The same picture again: its image hash finds the prefix, picture included, in the cache.
    assert shape.usage.input_tokens_details.cached_tokens > TOKENS_PER_IMAGE


def test_streamed_partial_images_arrive_in_order(client):
    full = client.responses.create(model="shapes-vl", input=SCENE.prompt(), tools=[TOOL])
    events = list(client.responses.create(
        model="shapes-vl", input=SCENE.prompt(), stream=True,
        tools=[{**TOOL, "partial_images": 2}]))
    names = [e.type for e in events]
    assert names[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added",
                         "response.image_generation_call.in_progress",
                         "response.image_generation_call.generating"]
    assert names[-3:] == ["response.image_generation_call.completed",
                          "response.output_item.done", "response.completed"]
    partials = [e for e in events if e.type == "response.image_generation_call.partial_image"]
    assert names[5:-3] == [p.type for p in partials]
    assert [p.partial_image_index for p in partials] == [0, 1]
    for p in partials:
        assert Image.open(io.BytesIO(base64.b64decode(p.partial_image_b64))).format == "PNG"
    final = events[-1].response.output[0]
    assert np.array_equal(_png(final.result), _png(full.output[0].result))
