"""`genserve serve --diffusion-cp 2` on the CPU (two gloo ranks), through the official openai
client: the same PNG as one device for the same seed, a size whose tokens do not split is a
400, and models that cannot be split stop the server at start-up with a one-line reason."""

from __future__ import annotations

import base64
import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from tests.serve_process import free_port, serve_subprocess

pytestmark = pytest.mark.slow

FLAGS = ("--no-llm", "--diffusion-model-path", "tiny-flux", "--diffusion-cp", "2")


def _one_device(seed: int) -> np.ndarray:
    from genserve.multimodal_gen.messages import DiffusionRequest, StepCacheConfig
    from genserve.multimodal_gen.pipelines import load_model
    from genserve.multimodal_gen.validation import resolve_request

    model = load_model("tiny-flux")
    req = DiffusionRequest("ref", "tiny-flux", "a red cat", width=32, height=32, seed=seed,
                           num_inference_steps=2)
    out = model.generate([resolve_request(req, model.spec, StepCacheConfig())])
    return out.frames[0][0]


def test_serve_cp2_draws_the_png_one_device_draws():
    import openai

    with serve_subprocess(*FLAGS) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        image = client.images.generate(
            model="tiny-flux", prompt="a red cat", size="32x32", response_format="b64_json",
            extra_body={"seed": 3, "num_inference_steps": 2})
        png = Image.open(io.BytesIO(base64.b64decode(image.data[0].b64_json)))
        assert np.array_equal(np.asarray(png.convert("RGB")), _one_device(3))
        with pytest.raises(openai.BadRequestError) as err:
            client.images.generate(model="tiny-flux", prompt="a red cat", size="48x48",
                                   extra_body={"num_inference_steps": 2})
        assert "--diffusion-cp 2" in err.value.message and "9 tokens" in err.value.message


def test_serve_cp2_refuses_models_that_cannot_be_split_at_start_up():
    # Without --diffusion-model-path: the demo models, whose own pipeline cannot be split.
    proc = subprocess.run(
        [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--no-llm", "--port",
         str(free_port()), "--diffusion-cp", "2"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "'shapes-image' (family shapes) cannot be split over several devices" in proc.stderr


def test_serve_refuses_cp_with_several_workers_or_behind_the_router():
    for flags, message in ((("--diffusion-workers", "2"), "cannot be combined with "
                                                           "--diffusion-workers"),
                           (("--dp", "2"), "--dp scales the LLM runtime out")):
        proc = subprocess.run(
            [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--port",
             str(free_port()), *FLAGS, *flags], capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
