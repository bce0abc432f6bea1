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
from tests.realtime.browser import launch_chromium, open_ui
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
            # The page starts on the streaming model (test below); picking the demo video
            # model fills in its defaults and shows the prompts it understands, and the prompt
            # box holds one of them.
            page.select_option("#model", "shapes-video")
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


# Keeps every final frame the page draws: its index and the canvas's RGB pixels (base64).
_KEEPER = """
() => {
  const rt = window.genserveRealtime;
  const canvas = document.getElementById("canvas");
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  window.__frames = [];
  let seen = 0;
  const tick = () => {
    if (rt.stats.finalsDrawn > seen) {
      seen = rt.stats.finalsDrawn;
      const { data } = ctx.getImageData(0, 0, canvas.width, canvas.height);
      const rgb = new Uint8Array((data.length / 4) * 3);
      for (let i = 0, j = 0; i < data.length; i += 4, j += 3) {
        rgb[j] = data[i]; rgb[j + 1] = data[i + 1]; rgb[j + 2] = data[i + 2];
      }
      let text = "";
      for (let i = 0; i < rgb.length; i += 8192) {
        text += String.fromCharCode.apply(null, rgb.subarray(i, i + 8192));
      }
      window.__frames.push({ index: seen, width: canvas.width, height: canvas.height,
                             rgb: btoa(text) });
    }
    requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
}
"""


def test_web_ui_streams_the_default_model_through_a_prompt_switch(real_server):
    """`genserve serve`'s web UI with no choices made: it picks the streaming demo model and
    plays one continuous video; a new prompt mid-stream changes the colour without a cut (the
    shape's centre, read off the canvas, never jumps)."""
    import base64

    from genserve.demo_models import stream_evaluate, stream_world

    base, client = real_server
    first = "a red circle moving right on a black background"
    second = "a blue circle moving right on a black background"
    with sync_api.sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page, console_errors = open_ui(browser, base, "shapes-stream")
            assert page.input_value("#model") == "shapes-stream"
            assert page.is_checked("#continuous")
            page.fill("#width", "64")
            page.fill("#height", "64")
            page.fill("#seed", "5")
            page.fill("#prompt", first)
            page.evaluate(_KEEPER)
            page.click("#start")
            stats = "window.genserveRealtime.stats"
            page.wait_for_function(f"{stats}.finalsDrawn >= 27", timeout=60_000)
            page.fill("#prompt", second)
            page.click("#send-prompt")
            page.wait_for_function(f"{stats}.lastChunkStats.prompt === '{second}'",
                                   timeout=60_000)
            # Chunks arrive ahead of playback: play five more, past those queued.
            shown = page.evaluate(f"{stats}.finalsDrawn")
            page.wait_for_function(f"{stats}.finalsDrawn >= {shown + 45}", timeout=60_000)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "realtime_stream_webui.png"), full_page=True)
            page.click("#stop")
            page.wait_for_function("document.body.dataset.state === 'stopped'",
                                   timeout=30_000)
            kept = page.evaluate("window.__frames")
            last = page.evaluate(f"{stats}.lastChunkStats")
        finally:
            browser.close()
    assert not console_errors, console_errors
    assert last["scene"] == 0 and last["prompt"] == second  # one scene throughout
    frames = [(k["index"], np.frombuffer(base64.b64decode(k["rgb"]), np.uint8)
               .reshape(k["height"], k["width"], 3)) for k in kept]
    readings = [(i, stream_evaluate.read_frame(f)) for i, f in frames]
    # Continuity between frames drawn one after the other, the prompt switch included.
    height, width = frames[0][1].shape[:2]
    steps = [np.hypot(stream_world.torus_delta(a.centre[0], b.centre[0], width),
                      stream_world.torus_delta(a.centre[1], b.centre[1], height))
             for (i, a), (j, b) in zip(readings, readings[1:])
             if j == i + 1 and a.centre is not None and b.centre is not None]
    assert len(steps) >= 45 and max(steps) <= width * stream_evaluate.MAX_STEP, steps
    assert all(r.centre is not None for _, r in readings)
    colours = [r.colour for _, r in readings]
    assert colours[:9].count("red") >= 8 and colours[-9:].count("blue") >= 8, colours
    assert all(r.background == "black" for _, r in readings)
