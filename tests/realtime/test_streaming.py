"""Streaming video over the realtime WebSocket with a real worker serving `tiny-helios` (and
`tiny-wan`, a model that cannot stream): a continuous session is one video, equal to diffusers'
own pipeline making those chunks in one call; a prompt change and a reset continue or restart
the scene; stop, disconnect and bad input leave no stream state behind; /v1/videos makes a
long video of whole chunks. One worker serves the module."""

from __future__ import annotations

import asyncio
import io
import json
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
import websockets

from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from genserve.multimodal_gen.embedded import build_embedded
from genserve.multimodal_gen.messages import ResolvedRequest, StepCacheConfig
from genserve.multimodal_gen.pipelines import load_model
from tests.realtime.client import Received, receive_until, run_session, ws_url
from tests.realtime.server import serve

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

CHUNK = 33


@pytest.fixture(scope="module")
def server():
    from genserve.multimodal_gen.launch import start_diffusion_client

    client = start_diffusion_client(["tiny-helios", "tiny-wan"], SimpleNamespace())
    try:
        app = create_app(GatewayConfig(), [], client)
        with serve(app) as base:
            yield base, client
    finally:
        asyncio.run(client.shutdown())


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-helios")


def _start(**overrides):
    start = dict(model="tiny-helios", prompt="a red cat", width=64, height=64,
                 num_inference_steps=2, fps=120, seed=7, preview_format="rgb",
                 continuous=True, max_chunks=3)
    start.update(overrides)
    return start


def _frames(out: Received) -> np.ndarray:
    return np.stack([rgb for _, rgb in out.finals]).astype(np.int16)


def _reference(model, seed: int, prompts: list[str], scenes: list[int]) -> np.ndarray:
    """The in-process family making the same chunks (it equals diffusers:
    tests/diffusion/test_helios.py): a new stream at each new scene, seeded seed + scene."""
    frames, stream, scene = [], None, None
    for k, (prompt, chunk_scene) in enumerate(zip(prompts, scenes)):
        if chunk_scene != scene:
            stream, scene = model.new_stream(seed + chunk_scene, 64, 64), chunk_scene
        req = ResolvedRequest(
            rid=f"ref{k}", model="tiny-helios", prompt=prompt, negative_prompt=None,
            width=64, height=64, num_frames=CHUNK, fps=8, num_inference_steps=2,
            guidance_scale=1.0, seeds=(seed + chunk_scene,), step_cache=StepCacheConfig(),
            preview=False, preview_decode_every=0, init_image=None, strength=None,
            submitted_at=time.time())
        frames.append(model.generate([req], streams=[stream]).frames[0])
    return np.concatenate(frames).astype(np.int16)


def _wait_streams_freed(client, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.stream_stats()["streams"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.stream_stats() == {"streams": 0, "stream_bytes": 0}
    assert client.integrity_error is None


def test_continuous_session_is_one_video_equal_to_diffusers(server):
    base, client = server
    out = asyncio.run(run_session(base, _start(), timeout_s=120))
    assert out.messages[0]["type"] == "started" and out.messages[0]["streaming"] is True
    assert out.order[-1] == "json:done", out.messages[-3:]
    frames = _frames(out)
    assert frames.shape == (3 * CHUNK, 64, 64, 3)
    pipe = build_embedded("tiny-helios")
    ref = pipe(prompt="a red cat", generator=torch.Generator().manual_seed(7),
               num_inference_steps=2, guidance_scale=1.0, height=64, width=64,
               num_frames=3 * CHUNK, output_type="np").frames[0]
    ref = (ref * 255).round().astype(np.int16)
    assert np.abs(frames[: len(ref)] - ref).max() <= 1
    stats = [m["stats"] for m in out.of_type("chunk_done")]
    assert [s["scene"] for s in stats] == [0, 0, 0]
    assert all(s["realtime_factor"] > 0 and s["frames"] == CHUNK for s in stats)
    _wait_streams_freed(client)
    metrics = httpx.get(base + "/metrics").text
    assert "genserve:diffusion_streams 0.0" in metrics


def test_two_sessions_at_once_each_equal_diffusers(server):
    base, client = server

    async def both():
        return await asyncio.gather(
            run_session(base, _start(), timeout_s=120),
            run_session(base, _start(prompt="a blue dog", seed=9), timeout_s=120))

    pipe = build_embedded("tiny-helios")
    for out, (prompt, seed) in zip(asyncio.run(both()), (("a red cat", 7), ("a blue dog", 9))):
        assert out.order[-1] == "json:done", out.messages[-3:]
        ref = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed),
                   num_inference_steps=2, guidance_scale=1.0, height=64, width=64,
                   num_frames=3 * CHUNK, output_type="np").frames[0]
        ref = (ref * 255).round().astype(np.int16)
        assert np.abs(_frames(out)[: len(ref)] - ref).max() <= 1
        assert all(m["stats"]["batch_size"] in (1, 2) for m in out.of_type("chunk_done"))
    _wait_streams_freed(client)


async def _session_with(base: str, message: dict, until) -> Received:
    """A continuous session that sends `message` once the first chunk is done, and stops
    once a chunk's stats satisfy `until` (generation runs ahead of playback, so which chunk
    first follows the message depends on timing; each chunk's stats say what it was made
    with)."""
    out = Received()
    async with websockets.connect(ws_url(base), max_size=None) as ws:
        await ws.send(json.dumps({"type": "start", **_start(max_chunks=None)}))
        await receive_until(ws, out, {"chunk_done", "error"}, 120)
        await ws.send(json.dumps(message))
        while not until(out.messages[-1]["stats"]):
            await receive_until(ws, out, {"chunk_done", "error"}, 120)
        await ws.send(json.dumps({"type": "stop"}))
        await receive_until(ws, out, {"done", "error"}, 120)
    return out


def _played(out: Received) -> tuple[np.ndarray, list[dict]]:
    """The frames of the chunks played in full (each chunk_done follows its frames)."""
    stats = [m["stats"] for m in out.of_type("chunk_done")]
    return _frames(out)[: len(stats) * CHUNK], stats


def test_prompt_change_and_reset_continue_or_restart_the_scene(server, model):
    base, client = server
    out = asyncio.run(_session_with(base, {"type": "prompt", "prompt": "a blue dog"},
                                    lambda stats: stats["prompt"] == "a blue dog"))
    assert out.messages[-1]["type"] == "done", out.messages[-3:]
    frames, stats = _played(out)
    prompts = [s["prompt"] for s in stats]
    # The change applies from the next chunk the session submits, and the scene continues.
    assert prompts[0] == "a red cat" and prompts[-1] == "a blue dog"
    assert [s["scene"] for s in stats] == [0] * len(stats)
    assert np.abs(frames - _reference(model, 7, prompts, [0] * len(stats))).max() <= 1

    out = asyncio.run(_session_with(base, {"type": "reset"},
                                    lambda stats: stats["scene"] == 1))
    assert out.messages[-1]["type"] == "done", out.messages[-3:]
    frames, stats = _played(out)
    scenes = [s["scene"] for s in stats]
    assert scenes[0] == 0 and scenes[-1] == 1 and sorted(scenes) == scenes
    ref = _reference(model, 7, ["a red cat"] * len(stats), scenes)
    assert np.abs(frames - ref).max() <= 1
    _wait_streams_freed(client)


def test_stop_and_disconnect_free_the_stream(server):
    base, client = server

    async def stop_mid_chunk():
        out = Received()
        async with websockets.connect(ws_url(base), max_size=None) as ws:
            await ws.send(json.dumps({"type": "start", **_start(max_chunks=None)}))
            await receive_until(ws, out, {"done", "error"}, 120, stop_after_previews=3)
        return out

    out = asyncio.run(stop_mid_chunk())
    assert out.messages[-1] == {"type": "done", "chunks": out.messages[-1]["chunks"],
                                "stopped": True}
    _wait_streams_freed(client)

    async def disconnect_mid_chunk():
        async with websockets.connect(ws_url(base), max_size=None) as ws:
            await ws.send(json.dumps({"type": "start", **_start(max_chunks=None)}))
            await receive_until(ws, Received(), {"chunk_done"}, 120)
        # leaving the block closes the socket while the next chunk runs

    asyncio.run(disconnect_mid_chunk())
    _wait_streams_freed(client)


def test_bad_streaming_input_gets_errors_and_the_socket_stays_usable(server):
    base, client = server

    async def session():
        got = []
        async with websockets.connect(ws_url(base), max_size=None) as ws:
            async def send(message):
                await ws.send(json.dumps(message))
                out = Received()
                got.append(await receive_until(ws, out, {"error", "done"}, 60))

            await send({"type": "reset"})  # idle
            await send({"type": "start", **_start(num_frames=9)})  # not a whole chunk
            await send({"type": "start", **_start(prompt="x" * 5000)})
            # tiny-wan cannot stream: reset while it runs is refused, the run goes on.
            await ws.send(json.dumps({"type": "start", "model": "tiny-wan", "prompt": "a cat",
                                      "width": 64, "height": 64, "num_inference_steps": 2,
                                      "fps": 120, "continuous": True, "max_chunks": 2}))
            await ws.send(json.dumps({"type": "reset"}))
            out = Received()
            got.append(await receive_until(ws, out, {"error"}, 60))
            got.append(await receive_until(ws, out, {"done"}, 120))
            # Still usable: a good streaming start runs.
            await send({"type": "start", **_start(max_chunks=1)})
        return got

    reset_idle, bad_frames, long_prompt, not_streaming, wan_done, good = asyncio.run(session())
    assert reset_idle["code"] == "not_running"
    assert bad_frames["code"] == "invalid_request" and "33" in bad_frames["message"]
    assert long_prompt["code"] == "invalid_request" and "prompt" in long_prompt["message"]
    assert not_streaming["code"] == "not_streaming"
    assert wan_done["type"] == "done" and wan_done["chunks"] == 2
    assert good["type"] == "done" and good["chunks"] == 1
    _wait_streams_freed(client)


def test_rest_long_video_is_whole_chunks(server):
    base, _ = server
    body = {"model": "tiny-helios", "prompt": "a red cat", "size": "64x64",
            "num_frames": 2 * CHUNK, "num_inference_steps": 2, "seed": 7, "fps": 8}
    job = httpx.post(base + "/v1/videos", json=body).json()
    deadline = time.monotonic() + 120
    while job["status"] in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.1)
        job = httpx.get(f"{base}/v1/videos/{job['id']}").json()
    assert job["status"] == "completed", job
    data = httpx.get(f"{base}/v1/videos/{job['id']}/content").content
    import imageio.v3 as iio

    frames = iio.imread(io.BytesIO(data), extension=".mp4")
    assert frames.shape[0] == 2 * CHUNK
    bad = httpx.post(base + "/v1/videos", json={**body, "num_frames": 40})
    assert bad.status_code == 400 and "33k+0" in bad.json()["error"]["message"]


def test_web_ui_streams_one_video_changes_prompt_twice_and_records_it(server):
    from playwright import sync_api

    from tests.realtime.browser import launch_chromium, open_ui

    base, client = server
    with sync_api.sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page, console_errors = open_ui(browser, base, "tiny-helios")
            page.select_option("#model", "tiny-helios")
            assert page.input_value("#frames") == str(CHUNK)  # one chunk, from the model card
            page.fill("#width", "64")
            page.fill("#height", "64")
            page.fill("#steps", "2")
            page.fill("#fps", "60")
            page.fill("#seed", "7")
            page.fill("#prompt", "a red cat")
            page.check("#continuous")
            page.click("#record")
            page.click("#start")
            stats = "window.genserveRealtime.stats"
            page.wait_for_function(f"{stats}.chunksDone >= 1", timeout=60_000)
            assert not page.is_disabled("#reset")  # a streaming run can start a new scene
            for prompt in ("a blue dog", "a green tree"):
                page.fill("#prompt", prompt)
                page.click("#send-prompt")
                # A chunk made with the new prompt was played.
                page.wait_for_function(f"{stats}.lastChunkStats.prompt === '{prompt}'",
                                       timeout=60_000)
            page.click("#stop")
            page.wait_for_function("document.body.dataset.state === 'stopped'",
                                   timeout=30_000)
            page.click("#record")
            page.wait_for_selector("#recording:not([hidden])", timeout=30_000)
            recording = page.evaluate("""async () => {
                const link = document.getElementById('recording');
                const bytes = new Uint8Array(await (await fetch(link.href)).arrayBuffer());
                return {name: link.download, size: bytes.length,
                        head: Array.from(bytes.slice(0, 4))};
            }""")
            last = page.evaluate(f"{stats}.lastChunkStats")
            drawn = page.evaluate(f"{stats}.finalsDrawn")
            factor = page.text_content("#realtime-factor")
        finally:
            browser.close()
    assert not console_errors, console_errors
    assert recording["name"].endswith(".webm") and recording["size"] > 1000
    assert recording["head"] == [0x1A, 0x45, 0xDF, 0xA3]  # a WebM (EBML) file
    assert last["scene"] == 0 and last["prompt"] == "a green tree"  # one scene throughout
    assert drawn >= 3 * CHUNK
    assert factor.endswith(("keeps up)", "slower than playback"))
    _wait_streams_freed(client)

