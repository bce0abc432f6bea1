"""`genserve serve --model-path <tiny Qwen2-VL folder>` as a user runs it: the official openai
client sends base64 images and gets Hugging Face's greedy tokens, native /generate takes
image_data, concurrent image and text requests stay exact, every bad image input is a 400 in
the error envelope, and the server keeps serving without leaking. The module's one server
serves the tiny Qwen2.5-VL and LLaVA folders next to it (the first model is Qwen2-VL, the one
an unnamed request gets)."""

from __future__ import annotations

import base64
import concurrent.futures
import sys

import httpx
import pytest

from tests.serve_process import serve_subprocess
from tests.srt.vlm_models import hf_reference, make_tiny_llava, make_tiny_qwen2_vl, png_bytes

pytestmark = pytest.mark.slow

IMG_A = png_bytes(56, 56, 1)
IMG_B = png_bytes(112, 84, 2)
IMG_C = png_bytes(84, 140, 3)


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory):
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


@pytest.fixture(scope="module")
def other_folders(tmp_path_factory) -> dict:
    """The other architectures' tiny folders, by name."""
    root = tmp_path_factory.mktemp("tiny-other-vlms")
    return {"qwen2_5_vl": make_tiny_qwen2_vl(root / "qwen2_5_vl", "qwen2_5_vl"),
            "llava-clip": make_tiny_llava(root / "llava-clip")}


@pytest.fixture(scope="module")
def served(vlm_folder, other_folders):
    """(the `genserve serve` process, its URL): Qwen2-VL first, then the other folders."""
    others = [flag for folder in other_folders.values()
              for flag in ("--model-path", str(folder))]
    with serve_subprocess("--no-diffusion", "--model-path", str(vlm_folder), *others,
                          "--max-total-tokens", "4096", "--max-images-per-request", "3",
                          "--max-image-bytes", "60000",
                          "--allowed-image-domains", "localhost") as (proc, url):
        yield proc, url


@pytest.fixture(scope="module")
def server(served) -> str:
    return served[1]


@pytest.fixture(scope="module")
def hf(vlm_folder):
    import torch
    import transformers as tf

    model = tf.AutoModelForImageTextToText.from_pretrained(vlm_folder, dtype=torch.float32)
    tok = tf.AutoTokenizer.from_pretrained(vlm_folder)

    def run(content: list, n: int = 32) -> tuple[list[int], str]:
        parts = [{"type": "image"} if isinstance(p, bytes) else {"type": "text", "text": p}
                 for p in content]
        text = tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                       add_generation_prompt=True)
        images = [p for p in content if isinstance(p, bytes)]
        ids = hf_reference(vlm_folder, tok.encode(text), images, n, model=model)
        return ids, tok.decode(ids, skip_special_tokens=True)

    return run


def openai_content(content: list) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": data_url(p), "detail": "auto"}}
            if isinstance(p, bytes) else {"type": "text", "text": p} for p in content]


def _maps_torch(pid: int) -> bool:
    """Whether the process has torch's C++ library mapped (it imported torch)."""
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/maps")
def test_the_gateway_process_stays_torch_free_while_serving_images(vlm_folder, served):
    """Image preprocessing runs in the scheduler process; the gateway only reads image sizes."""
    import psutil

    proc, url = served
    content = [{"type": "image_url", "image_url": {"url": data_url(IMG_B)}},
               {"type": "text", "text": "what is the color of the shape ?"}]
    body = {"model": vlm_folder.name, "max_tokens": 4,
            "messages": [{"role": "user", "content": content}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert not _maps_torch(proc.pid), "the gateway process imported torch"
    # The check can fail: the scheduler process (a child) runs the model on torch.
    children = psutil.Process(proc.pid).children(recursive=True)
    assert any(_maps_torch(c.pid) for c in children)


def test_openai_client_sends_images_and_gets_hf_tokens(server, hf):
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    models = client.models.list().data
    assert models[0].model_dump()["modalities"] == ["text", "image"]
    convs = [
        [IMG_A, "what is in the image ?"],
        ["compare", IMG_B, "and", IMG_C, "?"],
        ["how many red square ?"],  # text-only, batched with the others
        [IMG_C, "describe this picture ."],
    ]

    def ask(content: list) -> str:
        r = client.chat.completions.create(
            model=models[0].id, messages=[{"role": "user", "content": openai_content(content)}],
            max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 32
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(ask, convs))
    for content, text in zip(convs, texts):
        assert text == hf(content)[1]
    # The same image again: its tokens come from the prefix cache, the encoder is not rerun.
    r = client.chat.completions.create(
        model=models[0].id, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": openai_content([IMG_A, "what is the color ?"])}])
    assert r.usage.prompt_tokens_details.cached_tokens >= 7
    metrics = httpx.get(server + "/metrics").text
    assert "genserve:vision_images_encoded" in metrics
    encoded = [line for line in metrics.splitlines()
               if line.startswith("genserve:vision_images_encoded{")]
    assert encoded and float(encoded[0].split()[-1]) == 3.0  # A, B, C: each encoded once


def test_native_generate_with_image_data(server, hf):
    text = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what is in the "
            "image ?<|im_end|>\n<|im_start|>assistant\n")
    body = {"text": text, "image_data": base64.b64encode(IMG_B).decode(),
            "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(server + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == hf([IMG_B, "what is in the image ?"])[0]
    batch = {"text": [text, "<|im_start|>user\nhow many ?<|im_end|>\n"],
             "image_data": [data_url(IMG_B), None],
             "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(server + "/generate", json=batch, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()[0]["output_ids"] == hf([IMG_B, "what is in the image ?"])[0][:8]


def _error(r: httpx.Response, status: int = 400) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err["message"]


def test_bad_image_inputs_are_400_and_the_server_keeps_serving(server):
    def image(url: str) -> dict:
        return {"type": "image_url", "image_url": {"url": url}}

    model = httpx.get(server + "/v1/models").json()["data"][0]["id"]

    def chat_m(parts: list[dict]) -> httpx.Response:
        return httpx.post(server + "/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": parts}]})

    assert "cannot be decoded" in _error(chat_m([image(data_url(b"\x89PNG garbage"))]))
    assert "cannot be decoded" in _error(chat_m([image(data_url(IMG_B[:200]))]))
    assert "neither" in _error(chat_m([image("%%% not base64 %%%")]))
    assert "at most 3" in _error(chat_m([image(data_url(IMG_A))] * 4))
    big = png_bytes(200, 200, 7)  # ~120 KB of noise > --max-image-bytes 60000
    assert "byte limit" in _error(chat_m([image(data_url(big))]))
    assert "allowed-image-domains" in _error(chat_m([image("https://example.com/cat.png")]))
    # localhost is allowed by name but resolves to loopback: refused before any connection.
    assert "non-public" in _error(chat_m([image("http://localhost:9/cat.png")]))
    assert "0 image placeholders" in _error(httpx.post(server + "/generate", json={
        "text": "no placeholder here", "image_data": data_url(IMG_A)}))
    ok = chat_m([image(data_url(IMG_A)), {"type": "text", "text": "what ?"}])
    assert ok.status_code == 200
    info = httpx.get(server + "/get_server_info").json()
    assert info.get("integrity_error") is None


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava-clip"])
def test_other_architectures_over_http_equal_hf(arch, other_folders, server):
    import openai
    import transformers as tf

    folder = other_folders[arch]
    tok = tf.AutoTokenizer.from_pretrained(folder)
    content = ["compare", IMG_B, "and", IMG_C, "?"]
    parts = [{"type": "image"} if isinstance(p, bytes) else {"type": "text", "text": p}
             for p in content]
    text = tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                   add_generation_prompt=True)
    ref = hf_reference(folder, tok.encode(text), [IMG_B, IMG_C], 32)
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    model = folder.name
    assert model in [m.id for m in client.models.list().data]
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": openai_content(content)}],
        max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    native = httpx.post(server + "/generate", timeout=120, json={
        "model": model, "text": text, "image_data": [data_url(IMG_B), data_url(IMG_C)],
        "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}})
    assert native.status_code == 200, native.text
    assert native.json()["output_ids"] == ref
