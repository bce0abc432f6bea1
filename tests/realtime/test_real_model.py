"""Realtime video with the real default diffusion models (the trained demo models, as `genserve
serve` loads them) through the real diffusion client and the full gateway app: the protocol over
`websockets`, and the web UI in headless Chromium. One worker process serves the whole module."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import websockets
from playwright import sync_api

from genserve.demo_models import world
from genserve.demo_models.scorer import score_video
from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from genserve.entrypoints.realtime.frames import FrameFormat
from tests.realtime.browser import launch_chromium
from tests.realtime.client import Received, receive_until, run_session, ws_url
from tests.realtime.server import serve

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


@pytest.fixture(scope="module")
def real_server():
    from genserve.multimodal_gen.launch import start_diffusion_client

    client = start_diffusion_client(None, SimpleNamespace())  # the default models
    try:
        app = create_app(GatewayConfig(), [], client)
        with serve(app) as base:
            yield base, client
    finally:
        asyncio.run(client.shutdown())


PROMPT = "a red circle moving right on a white background"


def _start(**overrides):
    start = dict(model="shapes-video", prompt=PROMPT, width=64, height=64,
                 num_frames=16, num_inference_steps=4, fps=8, seed=3)
    start.update(overrides)
    return start


@pytest.mark.parametrize("fmt", ["webp", "jpeg", "rgb"])
def test_real_model_session(real_server, fmt):
    base, _ = real_server
    out = asyncio.run(run_session(base, _start(preview_format=fmt), timeout_s=120))
    assert out.messages[0]["type"] == "started", out.messages
    assert out.order[-1] == "json:done", out.messages[-3:]
    assert [m["step"] for m in out.of_type("progress")] == [1, 2, 3, 4]
    assert [h.step for h, _ in out.previews] == [1, 2, 3, 4]
    for header, rgb in out.previews:
        assert header.format == FrameFormat[fmt.upper()]
        assert rgb.shape == (header.height, header.width, 3) and header.width > 0
    assert [h.frame_index for h, _ in out.finals] == list(range(16))
    frames = np.stack([rgb for _, rgb in out.finals])
    assert frames.shape == (16, 64, 64, 3)
    if fmt == "rgb":  # lossless: the scorer sees what the model drew
        assert score_video(frames, world.parse_prompt(PROMPT))["background"]


async def _stop_then_restart(base: str) -> tuple[dict, Received]:
    async with websockets.connect(ws_url(base)) as ws:
        await ws.send(json.dumps({"type": "start", **_start(num_inference_steps=100)}))
        done = await receive_until(ws, Received(), {"done", "error"}, 60, stop_after_previews=2)
        again = Received()
        await ws.send(json.dumps({"type": "start", **_start(num_inference_steps=2)}))
        await receive_until(ws, again, {"done", "error"}, 60)
    return done, again


def test_real_model_stop_frees_the_worker(real_server):
    base, _ = real_server
    done, again = asyncio.run(_stop_then_restart(base))
    assert done == {"type": "done", "chunks": 0, "stopped": True}
    # The worker took the next request at once: the 100-step run did not keep it busy.
    assert again.order[-1] == "json:done" and len(again.finals) == 16


# Samples the canvas after every final frame the page draws (signature = mean of each channel
# plus a checksum of a pixel grid), so the test sees what a person would have seen.
_SAMPLER = """
() => {
  const rt = window.genserveRealtime;
  const canvas = document.getElementById("canvas");
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  window.__samples = [];
  let seen = 0;
  const tick = () => {
    if (rt.stats.finalsDrawn > seen) {
      seen = rt.stats.finalsDrawn;
      const { data } = ctx.getImageData(0, 0, canvas.width, canvas.height);
      let sum = 0, sq = 0, check = 0;
      for (let i = 0; i < data.length; i += 4) {
        const v = data[i] + data[i + 1] + data[i + 2];
        sum += v; sq += v * v; check = (check * 31 + v) % 1000000007;
      }
      const n = data.length / 4;
      window.__samples.push({ mean: sum / n, std: Math.sqrt(sq / n - (sum / n) ** 2), check });
    }
    requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
}
"""


def test_web_ui_plays_the_demo_video_model(real_server):
    base, _ = real_server
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 800})
            console_errors: list[str] = []
            page.on("console", lambda m: m.type == "error" and console_errors.append(m.text))
            page.on("pageerror", lambda e: console_errors.append(str(e)))
            page.goto(base + "/")
            page.wait_for_selector("#connection[data-status=open]", timeout=30_000)
            page.wait_for_function(
                "document.querySelector('#model option[value=\"shapes-video\"]') !== null",
                timeout=30_000)
            # The page chose the demo video model, filled in its defaults and shows the prompts
            # it understands; the prompt box starts with one of them.
            assert page.input_value("#model") == "shapes-video"
            assert page.input_value("#frames") == "16" and page.input_value("#fps") == "8"
            assert "moving {direction}" in page.text_content("#grammar")
            assert world.parse_prompt(page.input_value("#prompt")) is not None
            page.fill("#width", "64")
            page.fill("#height", "64")
            page.fill("#seed", "5")
            page.evaluate(_SAMPLER)
            page.click("#start")
            page.wait_for_function(
                "document.body.dataset.state === 'done' && "
                "window.genserveRealtime.stats.finalsDrawn === 16", timeout=120_000)
            page.wait_for_timeout(300)
            page.screenshot(path=str(ARTIFACTS / "realtime_webui.png"), full_page=True)
            stats = page.evaluate("window.genserveRealtime.stats")
            samples = page.evaluate("window.__samples")
            progress = page.evaluate("document.getElementById('progress').value")
            readouts = {k: page.text_content(f"#{k}") for k in
                        ("render-fps", "chunk-time", "frame-bytes", "preview-latency")}
        finally:
            browser.close()
    assert not console_errors, console_errors
    assert not stats["errors"], stats["errors"]
    assert progress == 1
    assert stats["previewsReceived"] >= 1
    # Every final frame shown (no drops), in order, never two within one 8 fps interval (the
    # page draws at most one final per 125 ms, less its 8 ms slack for the display's refresh;
    # a lower bound, which a busy machine cannot break).
    assert stats["finalsReceived"] == stats["finalsDrawn"] == 16
    gaps = np.diff(stats["finalDrawTimes"])
    assert gaps.min() >= 1000 / 8 - 8 - 1, gaps
    # The canvas shows pictures (not blank) that change from frame to frame.
    assert len(samples) == 16
    assert all(s["std"] > 1 and s["mean"] > 5 for s in samples), samples
    assert len({s["check"] for s in samples}) >= 8, samples  # the shape moves
    assert readouts["chunk-time"].endswith("ms") and readouts["preview-latency"].endswith("ms")
    assert readouts["frame-bytes"] != "–"
