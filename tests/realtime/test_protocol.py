"""The realtime WebSocket protocol, end to end through a real uvicorn server (fake engine)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import numpy as np
import pytest
import websockets

from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from genserve.entrypoints.realtime.frames import FrameFormat, FrameKind
from genserve.entrypoints.realtime.sender import FrameSender
from tests.realtime.client import Received, receive_until, run_session, ws_url
from tests.realtime.fake_diffusion import FakeDiffusionClient, fake_frames
from tests.realtime.server import serve

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def realtime_server(fake: FakeDiffusionClient, max_sessions: int = 4):
    app = create_app(GatewayConfig(max_realtime_sessions=max_sessions), [], fake)
    with serve(app) as base:
        yield base, app.state.gateway.realtime


@pytest.fixture
def paced(monkeypatch) -> list[tuple[float, float]]:
    """(not_before, clock when queued) of every final frame the server queues, in order: the
    schedule the sender keeps, read without timing anything."""
    log: list[tuple[float, float]] = []
    send_paced = FrameSender.send_paced

    def record(self, payload, not_before=0.0):
        if isinstance(payload, bytes):
            log.append((not_before, time.monotonic()))
        return send_paced(self, payload, not_before)

    monkeypatch.setattr(FrameSender, "send_paced", record)
    return log


def _start(**overrides):
    start = dict(prompt="a red ball", width=64, height=48, num_frames=5, num_inference_steps=4,
                 fps=20, seed=7)
    start.update(overrides)
    return start


@pytest.mark.parametrize("fmt", ["webp", "jpeg", "rgb"])
def test_session_streams_previews_then_paced_finals(fmt, paced):
    fake = FakeDiffusionClient(step_delay_s=0.03)
    with realtime_server(fake) as (base, serving):
        out = asyncio.run(run_session(base, _start(preview_format=fmt, preview_quality=90)))
        serving.check_integrity()
    started = out.messages[0]
    assert started["type"] == "started" and started["session_id"]
    assert (started["width"], started["height"], started["num_frames"]) == (64, 48, 5)
    assert started["preview_format"] == fmt
    assert [m["step"] for m in out.of_type("progress")] == [1, 2, 3, 4]
    assert all(m["total_steps"] == 4 for m in out.of_type("progress"))

    # One preview per step, each decodable at the size its header announces (the fake's
    # previews are half resolution, as a latent projection would be).
    assert [h.step for h, _ in out.previews] == [1, 2, 3, 4]
    for header, rgb in out.previews:
        assert header.format == FrameFormat[fmt.upper()]
        assert (header.width, header.height) == (32, 24) and rgb.shape == (24, 32, 3)

    # All final frames, in order, at full size, showing what the engine made.
    expected = fake_frames(7, 5, 48, 64)
    assert [h.frame_index for h, _ in out.finals] == [0, 1, 2, 3, 4]
    for header, rgb in out.finals:
        assert header.kind == FrameKind.FINAL and header.chunk == 0 and header.step == 4
        assert rgb.shape == (48, 64, 3)
        err = np.abs(rgb.astype(int) - expected[header.frame_index].astype(int)).mean()
        assert err < (0.01 if fmt == "rgb" else 8.0), err

    # Paced at 20 fps: frame i is due 50 ms after frame i-1, and nothing is sent before it is
    # due, so it cannot arrive before the 4 steps (>= 30 ms each) and i frame intervals have
    # passed since the start was sent (a lower bound: a busy machine only adds to it).
    due = [t for t, _ in paced]
    assert len(due) == 5 and np.allclose(np.diff(due), 0.05), due
    for i, arrived in enumerate(out.final_times):
        assert arrived - out.start_sent_at >= 4 * 0.03 + i * 0.05, (i, out.final_times)

    # chunk_done (with timings) follows the last frame; done is last.
    assert out.order[-2:] == ["json:chunk_done", "json:done"]
    assert out.order.index("json:chunk_done") > max(
        i for i, kind in enumerate(out.order) if kind == "final")
    stats = out.of_type("chunk_done")[0]["stats"]
    assert stats["frames"] == 5 and stats["generate_ms"] > 100 and stats["first_preview_ms"] > 0
    assert out.of_type("done")[0]["stopped"] is False


async def _bad_starts_then_good(base: str) -> list[dict]:
    errors = []
    async with websockets.connect(ws_url(base)) as ws:
        for bad in (
            "not json",
            json.dumps({"type": "start", "width": 64}),  # no prompt
            json.dumps({"type": "start", **_start(model="no-such-model")}),
            json.dumps({"type": "start", **_start(width=70)}),  # not a multiple of 16
            json.dumps({"type": "start", **_start(preview_format="gif")}),
            json.dumps({"type": "start", **_start(num_frames=6)}),  # frames must be 4k+1
            json.dumps({"type": "launch"}),
        ):
            await ws.send(bad)
            out = Received()
            errors.append(await receive_until(ws, out, {"error", "started"}, 10))
        out = Received()
        await ws.send(json.dumps({"type": "start", **_start()}))
        await receive_until(ws, out, {"done", "error"}, 30)
        errors.append(out.messages[-1])
    return errors


def test_bad_start_messages_get_errors_and_the_socket_stays_usable():
    with realtime_server(FakeDiffusionClient()) as (base, _):
        replies = asyncio.run(_bad_starts_then_good(base))
    codes = [r.get("code") for r in replies[:-1]]
    assert codes == ["invalid_json", "invalid_request", "model_not_found", "invalid_request",
                     "invalid_request", "invalid_request", "invalid_message"]
    assert "prompt" in replies[1]["message"]
    assert "fake-video" in replies[2]["message"]  # names the served models
    assert "multiple of 16" in replies[3]["message"]
    assert "preview_format" in replies[4]["message"]
    assert "4k+1" in replies[5]["message"]
    assert replies[-1]["type"] == "done"


async def _stop_midway(base: str) -> tuple[Received, Received]:
    out = Received()
    async with websockets.connect(ws_url(base)) as ws:
        await ws.send(json.dumps({"type": "start", **_start(num_inference_steps=60)}))
        done = await receive_until(ws, out, {"done", "error"}, 30, stop_after_previews=2)
        assert done["type"] == "done" and done["stopped"] is True
        again = Received()  # the same socket takes a new start
        await ws.send(json.dumps({"type": "start", **_start(num_inference_steps=2)}))
        await receive_until(ws, again, {"done", "error"}, 30)
    return out, again


def test_stop_cancels_the_generation_and_frees_the_worker():
    fake = FakeDiffusionClient(step_delay_s=0.05)
    with realtime_server(fake) as (base, serving):
        out, again = asyncio.run(_stop_midway(base))
        serving.check_integrity()
    assert not out.finals
    first_id = fake.requests[0].rid
    assert first_id in fake.cancelled and not fake.running
    # The engine stopped the run partway: the stop cancelled it, it did not run out.
    assert 2 <= fake.steps_run[first_id] < 60, fake.steps_run
    assert again.of_type("done")[0]["stopped"] is False and len(again.finals) == 5


async def _stop_during_playback(base: str) -> Received:
    out = Received()
    async with websockets.connect(ws_url(base)) as ws:
        await ws.send(json.dumps({"type": "start", **_start(num_inference_steps=1, fps=2)}))
        await receive_until(ws, out, {"done", "error"}, 30, stop_after_finals=1)
        again = Received()
        await ws.send(json.dumps({"type": "start", **_start(num_inference_steps=1, fps=2)}))
        await receive_until(ws, again, {"chunk_done"}, 30)
        assert len(again.finals) == 5
    return out


def test_stop_during_playback_drops_the_remaining_frames(paced):
    with realtime_server(FakeDiffusionClient()) as (base, serving):
        out = asyncio.run(_stop_during_playback(base))
        serving.check_integrity()
    # A new run plays at once: its first frame is due when it is queued, not in the stopped
    # run's time slots (which ran 2.5 s past the stop).
    assert len(paced) == 10
    first_due, queued_at = paced[5]
    assert first_due <= queued_at, paced
    # 5 frames at 2 fps take 2.5 s to play; stop after the first ends it at once.
    assert len(out.finals) <= 2
    assert out.messages[-1] == {"type": "done", "chunks": 1, "stopped": True}
    assert not out.of_type("chunk_done")


async def _disconnect_midway(base: str) -> None:
    async with websockets.connect(ws_url(base)) as ws:
        await ws.send(json.dumps({"type": "start", **_start(num_inference_steps=60)}))
        await receive_until(ws, Received(), {"progress"}, 10)


def test_disconnect_cancels_the_generation():
    fake = FakeDiffusionClient(step_delay_s=0.05)
    with realtime_server(fake) as (base, serving):
        asyncio.run(_disconnect_midway(base))
        deadline = time.monotonic() + 5
        while (fake.running or serving.active_sessions) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not fake.running and serving.active_sessions == 0
        serving.check_integrity()
    # It had started (the client saw a step) and was cancelled, not run out.
    rid = fake.requests[0].rid
    assert rid in fake.cancelled and 1 <= fake.steps_run[rid] < 60, fake.steps_run


async def _over_the_limit(base: str, serving) -> tuple[dict, int | None, dict]:
    async with websockets.connect(ws_url(base)) as first:
        await first.send(json.dumps({"type": "stop"}))  # idle stop: ignored, socket alive
        async with websockets.connect(ws_url(base)) as second:
            error = json.loads(await asyncio.wait_for(second.recv(), 10))
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(second.recv(), 10)
            code = second.close_code
    # The first closed: once the server has finished its handler (the client's close handshake
    # can complete a moment before), a new session is admitted again.
    deadline = time.monotonic() + 10
    while serving.active_sessions and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    out = Received()
    async with websockets.connect(ws_url(base)) as third:
        await third.send(json.dumps({"type": "start", **_start(num_inference_steps=1)}))
        done = await receive_until(third, out, {"done", "error"}, 30)
    return error, code, done


def test_session_limit_closes_with_1008():
    with realtime_server(FakeDiffusionClient(), max_sessions=1) as (base, serving):
        error, code, done = asyncio.run(_over_the_limit(base, serving))
        serving.check_integrity()
    assert error["type"] == "error" and error["code"] == "too_many_sessions"
    assert code == 1008
    assert done["type"] == "done"


async def _continuous(base: str) -> Received:
    out = Received()
    async with websockets.connect(ws_url(base)) as ws:
        await ws.send(json.dumps({"type": "start", **_start(
            prompt="first", num_inference_steps=3, fps=60, continuous=True, max_chunks=3)}))
        await receive_until(ws, out, {"progress"}, 10)
        await ws.send(json.dumps({"type": "prompt", "prompt": "second"}))
        await receive_until(ws, out, {"done", "error"}, 30)
    return out


def test_continuous_mode_takes_a_new_prompt_between_chunks(paced):
    playing: list[int] = []  # final frames still waiting in the sender as each chunk starts
    fake = FakeDiffusionClient(
        step_delay_s=0.03,
        on_request=lambda _: playing.append(
            sum(s.sender.paced_pending for s in serving._sessions.values())))
    with realtime_server(fake) as (base, serving):
        out = asyncio.run(_continuous(base))
        serving.check_integrity()
    assert [r.prompt for r in fake.requests] == ["first", "second", "second"]
    assert [r.seed for r in fake.requests] == [7, 8, 9]  # chunks differ, replayably
    assert [h.chunk for h, _ in out.finals] == [0] * 5 + [1] * 5 + [2] * 5
    assert [m["chunk"] for m in out.of_type("chunk_done")] == [0, 1, 2]
    assert out.of_type("done")[0]["chunks"] == 3
    # The next chunk generates while this one plays: when chunks 1 and 2 start, the previous
    # chunk's frames are still queued. Frames are due one interval apart at least, across
    # chunks too (no overlap), in order.
    assert playing[0] == 0 and all(n > 0 for n in playing[1:]), playing
    due = [t for t, _ in paced]
    assert len(due) == 15 and min(np.diff(due)) >= 1 / 60 - 1e-9, due


def test_web_ui_is_served_and_unknown_assets_are_404():
    with realtime_server(FakeDiffusionClient()) as (base, _):
        index = httpx.get(base + "/")
        assert index.status_code == 200 and "text/html" in index.headers["content-type"]
        assert "<canvas" in index.text and "/ui/app.js" in index.text
        for name in ("app.js", "decoder_worker.js", "styles.css"):
            asset = httpx.get(f"{base}/ui/{name}")
            assert asset.status_code == 200 and len(asset.text) > 100, name
        assert "javascript" in httpx.get(base + "/ui/app.js").headers["content-type"]
        missing = httpx.get(base + "/ui/secret.py")
        assert missing.status_code == 404 and "error" in missing.json()


async def _out_of_turn(base: str) -> list[dict]:
    replies = []
    async with websockets.connect(ws_url(base)) as ws:
        await ws.send(b"\x00\x01")  # binary from the client
        replies.append(await receive_until(ws, Received(), {"error"}, 10))
        await ws.send(json.dumps({"type": "prompt", "prompt": "x"}))  # nothing running
        replies.append(await receive_until(ws, Received(), {"error"}, 10))
        await ws.send(json.dumps({"type": "start", **_start(num_inference_steps=60)}))
        await receive_until(ws, Received(), {"started"}, 10)
        await ws.send(json.dumps({"type": "start", **_start()}))  # already running
        replies.append(await receive_until(ws, Received(), {"error"}, 10))
        await ws.send(json.dumps({"type": "stop"}))
        replies.append(await receive_until(ws, Received(), {"done"}, 10))
    return replies


def test_messages_out_of_turn_get_errors_without_ending_the_session():
    fake = FakeDiffusionClient(step_delay_s=0.05)
    with realtime_server(fake) as (base, serving):
        replies = asyncio.run(_out_of_turn(base))
        serving.check_integrity()
    assert [r.get("code") for r in replies[:3]] == ["invalid_message", "not_running", "busy"]
    assert replies[3]["stopped"] is True
    # The stop ended a generation the engine had really been given (and the busy start never
    # reached it).
    assert len(fake.requests) == 1 and fake.requests[0].rid in fake.cancelled


async def _one_session(base: str, origin: str | None) -> str:
    """Start a 2-step session with this Origin header (None: a client that is no browser);
    the type of the last message, or the HTTP status the handshake was refused with."""
    headers = {} if origin is None else {"Origin": origin}
    try:
        async with websockets.connect(ws_url(base), additional_headers=headers) as ws:
            await ws.send(json.dumps({"type": "start", **_start(num_inference_steps=2)}))
            return (await receive_until(ws, Received(), {"done", "error"}, 30))["type"]
    except websockets.InvalidStatus as refused:
        return str(refused.response.status_code)


def test_key_less_server_refuses_pages_of_other_origins():
    """Without --api-key nothing but the Origin check stops a web page from driving the model
    (browsers open WebSockets to any host without asking it): pages of other origins get 403
    before any work starts; clients that send no Origin, and the server's own page, work."""
    fake = FakeDiffusionClient()
    with realtime_server(fake) as (base, _):
        own = base.removeprefix("http://")
        for origin in ("http://evil.example", f"http://{own.split(':')[0]}:1", "null",
                       f"http://localhost:{own.split(':')[1]}"):
            assert asyncio.run(_one_session(base, origin)) == "403", origin
        assert fake.requests == []
        for origin in (None, f"http://{own}"):
            assert asyncio.run(_one_session(base, origin)) == "done", origin
        assert len(fake.requests) == 2
