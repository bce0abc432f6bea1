"""Image mode of the realtime protocol and the web UI, with real tiny diffusion models (tiny
Flux for text-to-image and image-to-image, FLUX.1 Kontext for instruction editing, Fill for
inpainting) in a real worker process behind the full gateway app: the protocol over
`websockets`, and the web UI in headless Chromium (generate, edit an uploaded picture, gallery)."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image
from playwright import sync_api

from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from tests.realtime.browser import launch_chromium
from tests.realtime.client import run_session
from tests.realtime.server import serve

pytestmark = [pytest.mark.timeout(300)]


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


PICTURE = _png(np.random.default_rng(5).integers(0, 256, (32, 32, 3), dtype=np.uint8))
MASK = np.zeros((32, 32), dtype=np.uint8)
MASK[:, 16:] = 255


@pytest.fixture(scope="module")
def live():
    from genserve import envs
    from genserve.multimodal_gen.engine_client import WorkerDiffusionClient
    from genserve.multimodal_gen.worker import WorkerConfig

    client = WorkerDiffusionClient(WorkerConfig(
        ("tiny-flux", "tiny-flux-kontext", "tiny-flux-fill"),
        num_threads=envs.GENSERVE_TEST_THREADS.get() or 1))
    try:
        app = create_app(GatewayConfig(), [], client)
        with serve(app, timeout_s=120) as base:
            yield base, client
    finally:
        asyncio.run(client.shutdown())


def _session(base, **start):
    start = {"prompt": "a red cat", "num_inference_steps": 3, "seed": 3,
             "preview_format": "rgb", **start}
    return asyncio.run(run_session(base, start, timeout_s=120))


def test_text_to_image_session_previews_each_step_then_one_final(live):
    base, _ = live
    out = _session(base, model="tiny-flux", width=32, height=32)
    started = out.messages[0]
    assert started["type"] == "started", out.messages
    assert started["task"] == "text-to-image" and started["images"] == 0
    assert out.order[-1] == "json:done", out.messages[-3:]
    # The sender drops a pending preview that a newer one overtakes (a slow client gets fresher
    # ones), never the newest: those sent arrive in step order and the last step always comes.
    steps = [h.step for h, _ in out.previews]
    assert steps == sorted(set(steps)) and set(steps) <= {1, 2, 3} and steps[-1] == 3, steps
    assert len(out.finals) == 1 and out.finals[0][1].shape == (32, 32, 3)


def test_edit_session_uses_the_uploaded_picture(live):
    base, client = live
    first = _session(base, model="tiny-flux-kontext", images=[_data_url(PICTURE)])
    assert first.messages[0]["task"] == "image-edit" and first.messages[0]["images"] == 1
    assert first.order[-1] == "json:done", first.messages[-3:]
    assert first.previews, "an edit shows its denoising steps too"
    assert first.finals[0][1].shape == (32, 32, 3)  # the picture's size
    other = _session(base, model="tiny-flux-kontext",
                     images=[base64.b64encode(_png(255 - first.finals[0][1])).decode()])
    assert other.order[-1] == "json:done", other.messages[-3:]
    assert not np.array_equal(first.finals[0][1], other.finals[0][1])
    # Inpainting with a mask, and image-to-image on a text-to-image model.
    filled = _session(base, model="tiny-flux-fill", images=[_data_url(PICTURE)],
                      mask=_data_url(_png(MASK)))
    assert filled.order[-1] == "json:done", filled.messages[-3:]
    img2img = _session(base, model="tiny-flux", images=[_data_url(PICTURE)], strength=0.6)
    assert img2img.messages[0]["width"] == 32 and img2img.order[-1] == "json:done"
    assert not client._inflight


@pytest.mark.parametrize("start, code, says", [
    ({"model": "tiny-flux-kontext"}, "invalid_request", "needs a reference image"),
    ({"model": "tiny-flux-kontext", "images": ["data:image/png;base64,@@"]},
     "invalid_request", "images.0"),
    ({"model": "tiny-flux-kontext", "images": [_data_url(b"not a picture")]},
     "invalid_request", "could not be decoded"),
    ({"model": "tiny-flux-kontext", "images": ["https://example.com/a.png"]},
     "invalid_request", "URLs are not fetched"),
    ({"model": "tiny-flux-fill", "images": [_data_url(PICTURE)]}, "invalid_request",
     "needs a mask"),
    ({"model": "tiny-flux", "images": [_data_url(PICTURE)], "mask": _data_url(_png(MASK))},
     "invalid_request", "does not inpaint"),
    ({"model": "tiny-flux", "strength": 0.5}, "invalid_request", "image-to-image only"),
])
def test_bad_image_inputs_are_errors_and_queue_nothing(live, start, code, says):
    base, client = live
    out = _session(base, **start)
    error = out.messages[-1]
    assert error["type"] == "error" and error["code"] == code, out.messages
    assert says in error["message"], error
    assert not client._inflight


def test_web_ui_image_mode_generates_edits_and_keeps_a_gallery(live, tmp_path):
    base, client = live
    upload = tmp_path / "cat.png"
    upload.write_bytes(PICTURE)
    with sync_api.sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = browser.new_page(accept_downloads=True)
            page.goto(base + "/")
            page.wait_for_selector("#connection[data-status=open]", timeout=20_000)
            # Image mode lists the text-to-image models; video-only controls go away.
            page.select_option("#mode", "image")
            page.wait_for_function("document.getElementById('model').value === 'tiny-flux'")
            assert page.is_hidden("#frames") and page.is_hidden("#continuous")
            page.fill("#prompt", "a red cat")
            page.fill("#width", "32")
            page.fill("#height", "32")
            page.fill("#steps", "3")
            page.click("#start")
            page.wait_for_function(
                "document.body.dataset.state === 'done' && "
                "document.querySelectorAll('#gallery li').length === 1", timeout=60_000)
            stats = page.evaluate("window.genserveRealtime.stats")
            assert stats["previewsReceived"] >= 1 and stats["finalsDrawn"] == 1, stats
            assert page.is_hidden("#error"), page.text_content("#error")
            item = page.locator("#gallery li").first
            assert "a red cat" in item.text_content()
            # Click to view it large; download it as a PNG.
            item.locator("button.view").click()
            page.wait_for_selector("#lightbox[open]")
            with page.expect_download() as download:
                page.click("#lightbox a.download")
            saved = tmp_path / "saved.png"
            download.value.save_as(saved)
            assert Image.open(saved).size == (32, 32)
            page.click("#lightbox-close")

            # Edit mode: upload a picture and give an instruction to an image-edit model.
            page.select_option("#mode", "edit")
            page.select_option("#model", "tiny-flux-kontext")
            assert page.is_visible("#image-input") and page.is_hidden("#mask-row")
            page.click("#start")  # no picture yet: the page says so, nothing is sent
            page.wait_for_selector("#error:not([hidden])")
            assert "picture" in page.text_content("#error")
            # A gallery image can be taken into edit mode; an upload replaces it.
            page.locator("#gallery li button.edit").first.click()
            page.wait_for_selector("#input-preview img")
            assert page.input_value("#mode") == "edit"
            assert page.input_value("#model") == "tiny-flux-kontext"
            page.set_input_files("#input-image", str(upload))
            page.wait_for_function("window.genserveRealtime.state.inputImages[0] === "
                                   f"'{_data_url(PICTURE)}'")
            page.fill("#prompt", "make it blue")
            page.click("#start")
            page.wait_for_function(
                "document.body.dataset.state === 'done' && "
                "document.querySelectorAll('#gallery li').length === 2", timeout=60_000)
            assert page.is_hidden("#error"), page.text_content("#error")
            settings = page.evaluate("window.genserveRealtime.state.settings")
            assert settings["task"] == "image-edit" and settings["images"] == 1, settings
            assert settings["width"] == 32 and settings["height"] == 32  # the upload's size
            assert "make it blue" in page.locator("#gallery li").first.text_content()
        finally:
            browser.close()
    assert not client._inflight
