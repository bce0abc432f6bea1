"""Editing, inpainting, image-to-video and LoRA through HTTP (real uvicorn server, diffusion
worker process, official openai client): FLUX.1 Kontext and Fill on /v1/images/edits, Wan
image-to-video on /v1/videos with `input_reference`, a LoRA adapter loaded at start and picked
per request; bad input is a 400 envelope that leaves nothing in flight."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from tests.diffusion.conftest import _threads
from tests.diffusion.helpers import LiveServer, error_of

FAST = {"num_inference_steps": 2}


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


PICTURE = _png(np.random.default_rng(5).integers(0, 256, (32, 32, 3), dtype=np.uint8))
MASK = np.zeros((32, 32), dtype=np.uint8)
MASK[:, 16:] = 255


@pytest.fixture(scope="module")
def live(tmp_path_factory, output_dir):

    from genserve.entrypoints.app import create_app
    from genserve.entrypoints.config import GatewayConfig
    from genserve.multimodal_gen.embedded import build_embedded
    from genserve.multimodal_gen.engine_client import WorkerDiffusionClient
    from genserve.multimodal_gen.worker import WorkerConfig
    from tests.diffusion.test_lora import make_lora

    flux = build_embedded("tiny-flux", shared=False)  # seed 0
    lora = make_lora(flux, tmp_path_factory.mktemp("lora") / "ink", 1)
    client = WorkerDiffusionClient(WorkerConfig(
        ("tiny-flux-kontext", "tiny-flux-fill", "tiny-wan-i2v", "tiny-flux",
         "tiny-qwen-image-edit", "tiny-flux2"),
        loras=(("tiny-flux", "ink", lora),), num_threads=_threads(), max_batch_size=4,
        batch_delay_ms=150))
    server = LiveServer(create_app(GatewayConfig(), llm_clients=[], diffusion_client=client))
    yield server, client
    server.stop()
    asyncio.run(client.shutdown())


@pytest.fixture
def http(live):
    import httpx

    with httpx.Client(base_url=live[0].url, timeout=60) as c:
        yield c


def _decode(item: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))))


def _edit(http, model, files, **fields):
    data = {"model": model, "prompt": "a red cat", "seed": "3", "response_format": "b64_json",
            **{k: str(v) for k, v in {**FAST, **fields}.items()}}
    return http.post("/v1/images/edits", data=data, files=files)


def test_models_show_tasks_adapters_and_scheduler(http):
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert cards["tiny-flux-kontext"]["task"] == "image-edit"
    assert cards["tiny-flux-fill"]["task"] == "inpainting"
    assert cards["tiny-wan-i2v"]["task"] == "image-to-video"
    assert cards["tiny-flux"]["lora_adapters"] == ["ink"]
    assert cards["tiny-flux"]["scheduler"]["class"] == "FlowMatchEulerDiscreteScheduler"
    assert cards["tiny-wan-i2v"]["step_cache"] is True


def test_instruction_edit_and_inpainting_with_the_openai_client(live):
    import openai

    client = openai.OpenAI(base_url=f"{live[0].url}/v1", api_key="x")
    edited = client.images.edit(model="tiny-flux-kontext", image=("in.png", PICTURE),
                                prompt="make it blue", response_format="b64_json",
                                extra_body=FAST)
    out = _decode(edited.data[0].model_dump())
    assert out.shape == (32, 32, 3)  # the reference image's size
    filled = client.images.edit(model="tiny-flux-fill", image=("in.png", PICTURE),
                                mask=("mask.png", _png(MASK)), prompt="a red cat",
                                response_format="b64_json", extra_body=FAST)
    assert _decode(filled.data[0].model_dump()).shape == (32, 32, 3)


def test_qwen_image_edit_with_the_openai_client(live, http):
    import openai

    # The edit pipeline reads the picture through Qwen2-VL's processor (built without
    # torchvision) and its VAE; a different picture gives a different edit.
    client = openai.OpenAI(base_url=f"{live[0].url}/v1", api_key="x")
    fields = {**FAST, "guidance_scale": 1.0, "seed": 3}
    first = client.images.edit(model="tiny-qwen-image-edit", image=("in.png", PICTURE),
                               prompt="make it blue", response_format="b64_json",
                               extra_body=fields)
    out = _decode(first.data[0].model_dump())
    assert out.shape == (32, 32, 3)
    other = client.images.edit(model="tiny-qwen-image-edit", image=("in.png", _png(255 - out)),
                               prompt="make it blue", response_format="b64_json",
                               extra_body=fields)
    assert not np.array_equal(out, _decode(other.data[0].model_dump()))
    r = _edit(http, "tiny-qwen-image-edit", [("image", PICTURE), ("image", PICTURE)])
    assert r.status_code == 400 and "at most 1" in error_of(r)["message"]


def test_flux2_generates_and_edits_from_several_references(live, http):
    import openai

    card = {m["id"]: m for m in http.get("/v1/models").json()["data"]}["tiny-flux2"]
    assert card["task"] == "text-to-image" and card["max_reference_images"] == 10
    client = openai.OpenAI(base_url=f"{live[0].url}/v1", api_key="x")
    rng = np.random.default_rng(6)
    first, second = (_png(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)) for _ in "ab")
    edited = client.images.edit(model="tiny-flux2", image=[("a.png", first), ("b.png", second)],
                                prompt="the cat from the first, the colours of the second",
                                response_format="b64_json", extra_body={**FAST, "size": "32x32"})
    out = _decode(edited.data[0].model_dump())
    assert out.shape == (32, 32, 3)
    drawn = client.images.generate(model="tiny-flux2", prompt="the cat from the first, the "
                                   "colours of the second", size="32x32",
                                   response_format="b64_json", extra_body={**FAST, "seed": 3})
    assert not np.array_equal(out, _decode(drawn.data[0].model_dump()))
    r = _edit(http, "tiny-flux2", [("image", first)], strength=0.5)
    assert r.status_code == 400 and "takes no strength" in error_of(r)["message"]
    r = _edit(http, "tiny-flux2", [("image", PICTURE)])  # 32 px: its pipeline needs 64
    assert r.status_code == 400
    assert "reference image 1 is 32x32; model tiny-flux2 needs at least 64" in error_of(r)[
        "message"]
    assert not live[1]._inflight


def test_reference_image_and_mask_change_the_output(http):
    base = _edit(http, "tiny-flux-fill", [("image", PICTURE), ("mask", _png(MASK))])
    other = _edit(http, "tiny-flux-fill", [("image", PICTURE), ("mask", _png(255 - MASK))])
    kontext = _edit(http, "tiny-flux-kontext", [("image", PICTURE)])
    kontext2 = _edit(http, "tiny-flux-kontext", [("image", _png(255 - _decode(
        kontext.json()["data"][0])))])
    for r in (base, other, kontext, kontext2):
        assert r.status_code == 200, r.text
    assert not np.array_equal(_decode(base.json()["data"][0]), _decode(other.json()["data"][0]))
    assert not np.array_equal(_decode(kontext.json()["data"][0]),
                              _decode(kontext2.json()["data"][0]))


@pytest.mark.parametrize("model, files, fields, says", [
    ("tiny-flux-fill", [("image", PICTURE), ("mask", _png(np.zeros((16, 32), np.uint8)))], {},
     "the mask is 32x16 but the image is 32x32"),
    ("tiny-flux-fill", [("image", PICTURE)], {}, "needs a mask"),
    ("tiny-flux-kontext", [("image", PICTURE), ("mask", _png(MASK))], {}, "takes no mask"),
    ("tiny-flux-kontext", [("image", b"not a picture")], {}, "could not be decoded"),
    ("tiny-flux-kontext", [("image", PICTURE), ("image", PICTURE)], {}, "at most 1"),
    ("tiny-wan-i2v", [("image", PICTURE)], {}, "image-to-video model"),
    ("tiny-flux", [("image", PICTURE), ("mask", _png(MASK))], {}, "does not inpaint"),
    ("tiny-flux", [("image", PICTURE)], {"lora": '{"pencil": 1}'}, "'pencil' is not loaded"),
])
def test_bad_edits_are_400_and_leave_nothing_in_flight(http, live, model, files, fields,
                                                       says):
    r = _edit(http, model, files, **fields)
    assert r.status_code == 400, r.text
    assert says in error_of(r)["message"]
    assert not live[1]._inflight  # the worker never saw it


def test_generation_on_an_edit_model_points_to_edits(http):
    r = http.post("/v1/images/generations", json={"model": "tiny-flux-kontext", "prompt": "x"})
    assert r.status_code == 400 and "/v1/images/edits" in error_of(r)["message"]


def _wait(http, video_id):
    for _ in range(600):
        job = http.get(f"/v1/videos/{video_id}").json()
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise AssertionError("the video job did not finish")


def test_image_to_video_with_input_reference(http, live):
    data = {"model": "tiny-wan-i2v", "prompt": "a bird flying", "size": "32x32",
            "num_frames": "5", **{k: str(v) for k, v in FAST.items()}}
    r = http.post("/v1/videos", data=data, files=[("input_reference", PICTURE)])
    assert r.status_code == 200, r.text
    job = _wait(http, r.json()["id"])
    assert job["status"] == "completed", job
    assert http.get(f"/v1/videos/{job['id']}/content").content[4:8] == b"ftyp"
    import openai

    client = openai.OpenAI(base_url=f"{live[0].url}/v1", api_key="x")
    video = client.videos.create(model="tiny-wan-i2v", prompt="a bird",
                                 input_reference=("first.png", PICTURE, "image/png"),
                                 size="32x32", extra_body={"num_frames": 5, **FAST})
    assert _wait(http, video.id)["status"] == "completed"


PICTURE_B64 = base64.b64encode(PICTURE).decode()


@pytest.mark.parametrize("ref", [
    f"data:image/png;base64,{PICTURE_B64}", PICTURE_B64,
    {"image_url": f"data:image/png;base64,{PICTURE_B64}"},
], ids=["data-url", "base64", "object"])
def test_image_to_video_with_input_reference_in_a_json_body(http, ref):
    body = {"model": "tiny-wan-i2v", "prompt": "a bird flying", "size": "32x32",
            "num_frames": 5, "input_reference": ref, "seed": 4, **FAST}
    r = http.post("/v1/videos", json=body)
    assert r.status_code == 200, r.text
    job = _wait(http, r.json()["id"])
    assert job["status"] == "completed", job
    assert http.get(f"/v1/videos/{job['id']}/content").content[4:8] == b"ftyp"


def test_input_reference_object_in_a_form(http):
    # An object field in a multipart form, written `field[key]`, as OpenAI's clients do.
    data = {"model": "tiny-wan-i2v", "prompt": "a bird", "size": "32x32", "num_frames": "5",
            "input_reference[image_url]": f"data:image/png;base64,{PICTURE_B64}",
            **{k: str(v) for k, v in FAST.items()}}
    r = http.post("/v1/videos", data=data)
    assert r.status_code == 200, r.text
    assert _wait(http, r.json()["id"])["status"] == "completed"


@pytest.mark.parametrize("ref, says", [
    ("data:image/png;base64,@@not base64@@", "valid base64"),
    (base64.b64encode(b"\x89PNG broken").decode(), "could not be decoded"),
    ({"image_url": "data:text/plain;base64,aGk="}, "image/* type"),
    ({"file_id": "file-123"}, "Files API"),
    ({}, "needs image_url"),
    ("https://example.com/first.png", "not fetched by this server"),
    ({"image_url": PICTURE_B64, "extra": 1}, "input_reference"),
])
def test_bad_json_input_reference_is_400(http, live, ref, says):
    body = {"model": "tiny-wan-i2v", "prompt": "a bird", "size": "32x32", "num_frames": 5,
            "input_reference": ref}
    r = http.post("/v1/videos", json=body)
    assert r.status_code == 400, r.text
    assert says in error_of(r)["message"]
    assert not live[1]._inflight


def test_input_reference_as_both_file_and_text_is_400(http):
    data = {"model": "tiny-wan-i2v", "prompt": "a bird", "size": "32x32", "num_frames": "5",
            "input_reference": PICTURE_B64}
    r = http.post("/v1/videos", data=data, files=[("input_reference", PICTURE)])
    assert r.status_code == 400 and "not both" in error_of(r)["message"]


@pytest.mark.parametrize("files, says", [
    ([("input_reference", b"\x89PNG broken")], "could not be decoded"),
    ([], "needs a reference image"),
])
def test_bad_image_to_video_is_400(http, live, files, says):
    data = {"model": "tiny-wan-i2v", "prompt": "a bird", "size": "32x32", "num_frames": "5"}
    r = http.post("/v1/videos", data=data, files=files or None)
    assert r.status_code == 400, r.text
    assert says in error_of(r)["message"]
    assert not live[1]._inflight


def test_lora_requests_apply_their_adapter_and_batch_together(http, live):
    def gen(lora=None, seed=3, **kw):
        body = {"model": "tiny-flux", "prompt": "a red cat", "size": "32x32", "seed": seed,
                "response_format": "b64_json", **FAST, **kw}
        if lora is not None:
            body["lora"] = lora
        r = http.post("/v1/images/generations", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_for_depth(depth):
        while client.queue_depth() < depth:
            assert not blocker.done(), "the blocking request ended before the others queued"
            time.sleep(0.01)

    client = live[1]
    plain = _decode(gen()["data"][0])
    ink = _decode(gen({"ink": 1.0})["data"][0])
    assert not np.array_equal(plain, ink)
    # A long request of another shape holds the worker while the four LoRA requests queue
    # behind it (the queue depth says when), so they meet in the queue whatever the timing.
    with ThreadPoolExecutor(5) as pool:
        blocker = pool.submit(gen, size="64x64", num_inference_steps=40)
        wait_for_depth(1)
        futures = [pool.submit(gen, {"ink": 1.0}, s) for s in (3, 4, 5, 6)]
        wait_for_depth(5)
        bodies = [f.result() for f in futures]
        assert blocker.result()["batch_size"] == 1
    assert np.array_equal(_decode(bodies[0]["data"][0]), ink)  # batched = alone
    assert [b["batch_size"] for b in bodies] == [4, 4, 4, 4], [b["batch_size"] for b in bodies]
