"""`genserve serve --model-path ...` on a tiny checkpoint of every pre-quantized format (FP8
block-wise and per-tensor, compressed-tensors W8A8 int8, FP8 and W4A16 pack-quantized, GPTQ, AWQ,
GPT-OSS's MXFP4) and every 2026 LLM family (DeepSeek-V2 and V3, GPT-OSS, Qwen3-VL and its MoE
variant, Gemma 3 with vision), all in one server as a user starts it: each is listed under its
folder's name, reports its checkpoint format, and answers the official openai client with
transformers' greedy answer (an image request for the vision models). The same server serves the
embedded tiny 2026 diffusion families (FLUX.2, Z-Image, Wan 2.2, HunyuanVideo 1.5, LTX-2), each
drawing through the client; their pixels are compared with diffusers' in tests/diffusion."""

from __future__ import annotations

import base64
import time

import httpx
import pytest

from tests.entrypoints.served_checkpoints import (
    decode_mp4,
    decode_png,
    image_answer,
    text_answer,
    write_checkpoints,
)
from tests.serve_process import serve_process
from tests.srt.vlm_models import png_bytes

pytestmark = [
    pytest.mark.slow,
    # transformers notes that the folder's own quantization_config wins over the one passed
    # (only its `dequantize` is taken): as meant.
    pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning"),
]

MAX_TOKENS = 8
TEXT_MODELS = [
    "fp8-block",
    "fp8-tensor",
    "ct-w8a8-int8",
    "ct-fp8",
    "ct-w4a16",
    "gptq",
    "awq",
    "gpt-oss-mxfp4",
    "deepseek-v2",
    "deepseek-v3",
]
VISION_MODELS = ["qwen3-vl", "qwen3-vl-moe", "gemma3-vision"]
QUESTION = [{"role": "user", "content": "what is a red circle ?"}]
IMAGE = png_bytes(64, 96, 1)
DIFFUSION_IMAGES = ["tiny-flux2", "tiny-z-image"]
DIFFUSION_VIDEOS = {"tiny-wan22-ti2v": 5, "tiny-hunyuan-video15": 5, "tiny-ltx2": 9}  # frames
FAST = {"num_inference_steps": 2, "seed": 1}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("served-checkpoints"))


@pytest.fixture(scope="module")
def server(checkpoints) -> str:
    paths = [flag for c in checkpoints.values() for flag in ("--model-path", str(c.folder))]
    paths += [
        flag
        for name in DIFFUSION_IMAGES + list(DIFFUSION_VIDEOS)
        for flag in ("--diffusion-model-path", name)
    ]
    with serve_process(*paths, "--max-total-tokens", "1024", diffusion=True) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key="none")


def test_every_checkpoint_is_listed_under_its_folder_name(client, checkpoints):
    assert sorted(TEXT_MODELS + VISION_MODELS) == sorted(checkpoints)
    kinds = {m.id: m.model_dump()["kind"] for m in client.models.list().data}
    diffusion = DIFFUSION_IMAGES + list(DIFFUSION_VIDEOS)
    assert kinds == {**dict.fromkeys(checkpoints, "llm"), **dict.fromkeys(diffusion, "diffusion")}


@pytest.mark.parametrize("name", TEXT_MODELS + VISION_MODELS)
def test_model_info_reports_the_architecture_and_format(name, server, checkpoints):
    ckpt = checkpoints[name]
    info = httpx.get(server + "/get_model_info", params={"model": name}).json()
    assert info["architecture"] == ckpt.architecture, info
    if ckpt.quantization is None:
        assert info["checkpoint_quantization"] is None, info
    else:
        assert info["checkpoint_quantization"].startswith(ckpt.quantization), info


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_chat_answer_equals_transformers(name, client, checkpoints):
    want = text_answer(checkpoints[name], QUESTION, MAX_TOKENS)
    r = client.chat.completions.create(
        model=name,
        messages=QUESTION,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == MAX_TOKENS
    assert r.choices[0].message.content == want


@pytest.mark.parametrize("name", VISION_MODELS)
def test_image_chat_answer_equals_transformers(name, client, checkpoints):
    text = "what is in the image ?"
    want = image_answer(checkpoints[name], IMAGE, text, MAX_TOKENS)
    url = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    r = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == MAX_TOKENS
    assert r.choices[0].message.content == want


@pytest.mark.parametrize("name", DIFFUSION_IMAGES)
def test_image_model_draws_through_the_client(name, client):
    r = client.images.generate(
        model=name, prompt="a red cat", size="32x32", response_format="b64_json", extra_body=FAST
    )
    pixels = decode_png(base64.b64decode(r.data[0].b64_json))
    assert pixels.shape == (32, 32, 3) and pixels.std() > 0


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
@pytest.mark.parametrize("name", list(DIFFUSION_VIDEOS))
def test_video_model_films_through_the_client(name, client, tmp_path):
    frames = DIFFUSION_VIDEOS[name]
    video = client.videos.create(
        model=name, prompt="a bird", size="32x32", extra_body={**FAST, "num_frames": frames}
    )
    deadline = time.monotonic() + 300  # a backstop against a hang, not a speed bound
    while video.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.05)
        video = client.videos.retrieve(video.id)
    assert video.status == "completed", video
    path = tmp_path / "clip.mp4"
    path.write_bytes(client.videos.download_content(video.id).content)
    clip = decode_mp4(path)
    assert clip.shape == (frames, 32, 32, 3) and clip.std() > 0
