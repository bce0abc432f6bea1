"""Realtime video benchmark (the protocol: docs/realtime_protocol.md).

1. Transport through the realtime session: a replay engine (`ReplayDiffusion`, no model) yields
   one pre-rendered 256x256 preview per denoising step, paced at `--rate` steps/s (the target,
   60) and at `--overload-rate` (faster than the transport, so what arrives is its capacity).
   The real gateway app (`create_app`) serves it on a real uvicorn server: each preview goes
   through `RealtimeSession`, `FrameSender` (WebP encode in its executor, latest-wins dropping)
   and the WebSocket to a client in another process that decodes every frame. Reported:
   previews delivered per second (target >= 60), `previews_dropped` from the session's
   `chunk_done` stats, and the delay from the engine's yield to the decoded frame.
2. Raw transport ceiling: the same frames encoded and sent by a bare WebSocket endpoint (no
   session, no sender), as the upper bound the session is compared with.
3. First-preview latency: after a warm-up session, the time from sending `start` to the first
   preview frame, against the budget of one denoising step + 100 ms (the step time is the median
   gap between previews of the same session).
4. Final-frame pacing: arrival gaps of a session's final frames against 1/fps.

Parts 3 and 4 run the real diffusion worker with the embedded tiny video model (`tiny-wan`).
Usage: python benchmarks/bench_realtime.py [--seconds 5] [--rate 60] [--overload-rate 500]
       [--sessions 3] [--fps 24] [--skip-model]
       python benchmarks/bench_realtime.py --smoke   # every part at a toy size: checks it
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import socket
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from functools import partial
from types import SimpleNamespace

import numpy as np
import uvicorn
import websockets
from fastapi import FastAPI, WebSocket

from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from genserve.entrypoints.realtime.frames import (
    FrameFormat,
    FrameKind,
    decode_frame,
    encode_frame,
    warm_up_encoders,
)
from genserve.multimodal_gen.client import DiffusionEngineClient
from genserve.multimodal_gen.messages import (
    STATUS_BAD_INPUT,
    STATUS_UNKNOWN_MODEL,
    TEXT_TO_VIDEO,
    DiffusionEvent,
    DiffusionRequest,
    ErrorEvent,
    ModelSpec,
    ResultEvent,
    StepCacheConfig,
    StepEvent,
)
from genserve.multimodal_gen.validation import resolve_request


@contextlib.contextmanager
def serve(app: FastAPI):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"ws://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


async def _session(url: str, start: dict) -> dict:
    """One session; arrival times of the first preview, previews and finals (s since start)."""
    previews: list[float] = []
    finals: list[float] = []
    stats: dict = {}
    async with websockets.connect(url + "/v1/realtime/video", max_size=None) as ws:
        t0 = time.perf_counter()
        await ws.send(json.dumps({"type": "start", **start}))
        while True:
            data = await asyncio.wait_for(ws.recv(), 120)
            now = time.perf_counter() - t0
            if isinstance(data, bytes):
                header, _ = decode_frame(data)
                (previews if header.kind == FrameKind.PREVIEW else finals).append(now)
                continue
            msg = json.loads(data)
            if msg["type"] == "error":
                raise RuntimeError(msg["message"])
            if msg["type"] == "chunk_done":
                stats = msg["stats"]
            if msg["type"] == "done":
                return {"previews": previews, "finals": finals, "stats": stats}


def bench_latency_and_pacing(url: str, args) -> dict:
    base = dict(model="tiny-wan", prompt="a red cat walking in the city", width=64, height=64,
                num_frames=9, num_inference_steps=args.steps, fps=8, seed=1)
    asyncio.run(_session(url, base))  # warm-up: first-call costs (allocations, caches)
    rows = []
    for i in range(args.sessions):
        r = asyncio.run(_session(url, {**base, "seed": 10 + i}))
        step_s = statistics.median(np.diff(r["previews"])) if len(r["previews"]) > 1 else 0.0
        first = r["previews"][0]
        # The server's own time from submitting the request to the engine's first preview:
        # the rest of the client's latency is the realtime layer + transport + decode.
        engine_ms = r["stats"].get("first_preview_ms") or 0.0
        rows.append({"first_preview_ms": first * 1e3, "step_ms": step_s * 1e3,
                     "over_budget_ms": (first - step_s) * 1e3 - 100,
                     "engine_first_preview_ms": engine_ms,
                     "engine_queue_ms": r["stats"].get("engine_queue_ms", 0.0),
                     "realtime_overhead_ms": first * 1e3 - engine_ms})
    pacing_start = {**base, "num_frames": 33, "fps": args.fps, "num_inference_steps": 2}
    finals = asyncio.run(_session(url, pacing_start))["finals"]
    gaps = np.diff(finals) * 1e3
    target = 1e3 / args.fps
    return {
        "latency": rows,
        "latency_ok": all(r["over_budget_ms"] <= 0 for r in rows),
        "pacing": {
            "fps": args.fps, "frames": len(finals), "target_gap_ms": round(target, 2),
            "mean_gap_ms": round(float(gaps.mean()), 2),
            "p95_abs_error_ms": round(float(np.percentile(np.abs(gaps - target), 95)), 2),
            "max_gap_ms": round(float(gaps.max()), 2),
            "late_frames": int((gaps > 1.5 * target).sum()),
            "achieved_fps": round((len(finals) - 1) / (finals[-1] - finals[0]), 2),
        },
    }


def _test_frames(n: int, noise: float, size: int = 256) -> list[np.ndarray]:
    """Smooth gradients with a moving disc, plus Gaussian noise of std `noise` (early denoising
    previews are noisy, the hardest content for WebP)."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    frames = []
    for i in range(n):
        t = i / max(1, n)
        r = (np.sin(6 * x + 6 * t) + 1) * 110
        g = (np.cos(5 * y - 4 * t) + 1) * 110
        b = ((x + y) * 0.5 * 200 + 30 * t) % 255
        cx, cy = 0.5 + 0.3 * np.cos(2 * np.pi * t), 0.5 + 0.3 * np.sin(2 * np.pi * t)
        disc = (x - cx) ** 2 + (y - cy) ** 2 < 0.01
        frame = np.stack([r, g, b], -1)
        frame[disc] = (250, 250, 40)
        if noise:
            frame = frame + rng.normal(0, noise, frame.shape)
        frames.append(np.clip(frame, 0, 255).astype(np.uint8))
    return frames


# ---- 1. transport through the realtime session ----

REPLAY_SIZE = 256
REPLAY = ModelSpec(
    name="replay", task=TEXT_TO_VIDEO, family="replay", size_factor=16,
    max_pixels=REPLAY_SIZE * REPLAY_SIZE, default_width=REPLAY_SIZE,
    default_height=REPLAY_SIZE, default_steps=4, default_guidance=1.0, max_steps=1000,
    default_num_frames=1, frame_rule="any", max_num_frames=4, default_fps=8,
    supports_negative_prompt=False, source="benchmark", step_cache=False,
)


class ReplayDiffusion(DiffusionEngineClient):
    """A diffusion client for this benchmark only: one 256x256 "video" model whose denoising
    steps carry pre-rendered frames as previews, one step every 1/`rate` s (`rate` None: as fast
    as the event loop allows). What is measured is then the gateway's realtime session, its
    sender and the WebSocket, not a model. Records when each step's preview was yielded
    (`time.monotonic`, which is one clock for every process of the machine)."""

    def __init__(self, frames: list[np.ndarray], rate: float | None) -> None:
        self.frames = frames
        self.rate = rate
        self.yielded_at: dict[tuple[str, int], float] = {}  # (rid, step) -> time
        self.finished: list[str] = []

    def specs(self) -> list[ModelSpec]:
        return [REPLAY]

    async def stream(self, req: DiffusionRequest) -> AsyncIterator[DiffusionEvent]:
        if req.model != REPLAY.name:
            yield ErrorEvent(req.rid, f"unknown model {req.model!r}", STATUS_UNKNOWN_MODEL)
            return
        try:
            r = resolve_request(req, REPLAY, StepCacheConfig())
        except ValueError as exc:
            yield ErrorEvent(req.rid, str(exc), STATUS_BAD_INPUT)
            return
        steps = r.num_inference_steps
        t0 = time.monotonic()
        for step in range(1, steps + 1):
            if self.rate is None:
                await asyncio.sleep(0)  # let the session's writer run between steps
            else:
                await asyncio.sleep(max(0.0, t0 + step / self.rate - time.monotonic()))
            preview = None
            if req.preview:
                frame = self.frames[step % len(self.frames)]
                preview = frame[None, : r.height, : r.width]
            self.yielded_at[(req.rid, step)] = time.monotonic()
            yield StepEvent(req.rid, step, steps, preview)
        outputs = np.stack([self.frames[i % len(self.frames)][: r.height, : r.width]
                            for i in range(r.num_frames)])
        self.finished.append(req.rid)
        yield ResultEvent(req.rid, [outputs], r.fps, 0, steps, {}, list(r.seeds))

    async def cancel(self, rid: str) -> bool:
        return False  # streams end on their own; closing one stops it at its next step

    def is_healthy(self) -> bool:
        return True

    def queue_depth(self) -> int:
        return 0

    async def shutdown(self) -> None:
        return None


async def receive_replay_session(url: str, steps: int, quality: int) -> dict:
    """Client side of part 1: one realtime session of the replay model; every frame is decoded
    to pixels, as the browser's worker does. Returns the JSON messages (types, in order), the
    step of each preview and when it was decoded (`time.monotonic`), the final frames' count
    and the `chunk_done` stats."""
    types: list[str] = []
    preview_steps: list[int] = []
    preview_times: list[float] = []
    finals = 0
    stats: dict = {}
    preview_bytes = 0
    async with websockets.connect(url + "/v1/realtime/video", max_size=None) as ws:
        await ws.send(json.dumps({
            "type": "start", "model": REPLAY.name, "prompt": "replay", "width": REPLAY_SIZE,
            "height": REPLAY_SIZE, "num_frames": 1, "num_inference_steps": steps,
            "preview_format": "webp", "preview_quality": quality,
        }))
        while True:
            data = await asyncio.wait_for(ws.recv(), 120)
            if isinstance(data, bytes):
                header, rgb = decode_frame(data)
                if rgb.shape != (REPLAY_SIZE, REPLAY_SIZE, 3):
                    raise RuntimeError(f"decoded a {rgb.shape} frame")
                if header.kind == FrameKind.PREVIEW:
                    preview_times.append(time.monotonic())
                    preview_steps.append(header.step)
                    preview_bytes += len(data)
                else:
                    finals += 1
                continue
            msg = json.loads(data)
            types.append(msg["type"])
            if msg["type"] == "error":
                raise RuntimeError(f"{msg['code']}: {msg['message']}")
            if msg["type"] == "chunk_done":
                stats = msg["stats"]
            if msg["type"] == "done":
                break
    return {"types": types, "preview_steps": preview_steps, "preview_times": preview_times,
            "preview_bytes": preview_bytes, "finals": finals, "stats": stats}


def _receive_replay_session(url: str, steps: int, quality: int) -> dict:
    return asyncio.run(receive_replay_session(url, steps, quality))


def bench_session_transport(steps: int, rate: float | None, quality: int, noise: float,
                            client_process: bool = True) -> dict:
    """Part 1: `steps` previews through the real session and sender to a decoding client.

    `client_process=False` runs the client in a thread of this process (the fast test does;
    a client sharing the server's GIL is slower, so the benchmark keeps it apart)."""
    client = ReplayDiffusion(_test_frames(64, noise), rate)
    app = create_app(GatewayConfig(max_realtime_sessions=1), [], client)
    with serve(app) as url:
        if client_process:
            with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as proc:
                r = proc.submit(_receive_replay_session, url, steps, quality).result(600)
        else:
            with ThreadPoolExecutor(1) as pool:
                r = pool.submit(_receive_replay_session, url, steps, quality).result(600)
    (rid,) = client.finished
    delays = [(t - client.yielded_at[(rid, s)]) * 1e3
              for s, t in zip(r["preview_steps"], r["preview_times"], strict=True)]
    times = r["preview_times"]
    received = len(times)
    span = times[-1] - times[0] if received > 1 else float("nan")
    fps = (received - 1) / span if received > 1 else 0.0
    stats = r["stats"]
    return {
        "engine_steps": steps,
        "engine_rate": rate or "unpaced",
        "previews_received": received,
        # As of chunk_done: up to two previews (one being written, one pending) may follow.
        "previews_sent": stats["previews_sent"],
        "previews_dropped": stats["previews_dropped"],
        "delivered_fps": round(fps, 1),
        "seconds": round(span, 3),
        "delay_ms_p50": round(float(np.percentile(delays, 50)), 2),
        "delay_ms_p95": round(float(np.percentile(delays, 95)), 2),
        "delay_ms_max": round(float(max(delays)), 2),
        "bytes_per_frame": r["preview_bytes"] // max(1, received),
        # For the protocol checks of the fast test.
        "preview_steps": r["preview_steps"],
        "message_types": r["types"],
        "finals": r["finals"],
    }


# ---- 2. raw transport ceiling ----


def _receive_frames(url: str) -> tuple[int, float, int]:
    """Client side of the transport benchmark: receive and fully decode every frame."""

    async def receive() -> tuple[int, float, int]:
        count, total_bytes = 0, 0
        async with websockets.connect(url + "/frames", max_size=None) as ws:
            t0 = time.perf_counter()
            with contextlib.suppress(websockets.ConnectionClosed):
                while True:
                    data = await ws.recv()
                    _, rgb = decode_frame(data)  # to pixels, as the browser's worker does
                    if rgb.shape != (256, 256, 3):
                        raise RuntimeError(f"decoded a {rgb.shape} frame")
                    count += 1
                    total_bytes += len(data)
            return count, time.perf_counter() - t0, total_bytes

    return asyncio.run(receive())


def bench_raw_transport(num_frames: int, quality: int, noise: float) -> dict:
    frames = _test_frames(64, noise)
    app = FastAPI()
    pool = ThreadPoolExecutor(2)
    warm_up_encoders()

    @app.websocket("/frames")
    async def send_frames(ws: WebSocket) -> None:
        await ws.accept()
        loop = asyncio.get_running_loop()
        # Encode one frame ahead in the pool while the previous one is written.
        encode = partial(encode_frame, kind=FrameKind.PREVIEW, fmt=FrameFormat.WEBP,
                         quality=quality, chunk=0, frame_index=0)
        pending = loop.run_in_executor(pool, partial(encode, frames[0], step=1))
        for i in range(num_frames):
            payload = await pending
            if i + 1 < num_frames:
                nxt = frames[(i + 1) % len(frames)]
                pending = loop.run_in_executor(pool, partial(encode, nxt, step=(i + 2) % 65536))
            await ws.send_bytes(payload)
        await ws.close()

    # The client runs in its own process, as a browser would: no GIL shared with the server.
    with serve(app) as url, ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as proc:
        count, elapsed, total_bytes = proc.submit(_receive_frames, url).result(timeout=300)
    pool.shutdown()
    return {"frames": count, "seconds": round(elapsed, 3), "fps": round(count / elapsed, 1),
            "bytes_per_frame": total_bytes // max(1, count), "target_fps": 60,
            "ok": count / elapsed >= 60}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="length of each transport session (at most 1000 steps)")
    parser.add_argument("--rate", type=float, default=60.0,
                        help="steps/s of the replay engine at the target rate")
    parser.add_argument("--overload-rate", type=float, default=500.0,
                        help="steps/s of the replay engine in the overload run")
    parser.add_argument("--sessions", type=int, default=3, help="measured latency sessions")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per session")
    parser.add_argument("--fps", type=int, default=24, help="fps of the pacing session")
    parser.add_argument("--quality", type=int, default=80)
    parser.add_argument("--skip-model", action="store_true",
                        help="only the transport parts (no diffusion worker)")
    parser.add_argument("--smoke", action="store_true",
                        help="0.1 s transport sessions, 1 latency session of 2 steps")
    args = parser.parse_args()
    if args.smoke:
        args.seconds, args.sessions, args.steps = 0.1, 1, 2

    warm_up_encoders()
    results: dict = {}
    hidden = ("preview_steps", "message_types", "finals")
    for content, noise in (("smooth", 0.0), ("noisy", 25.0)):
        for rate in (args.rate, args.overload_rate):
            key = f"session_webp_256_{content}_{rate:g}_per_s"
            steps = min(1000, round(args.seconds * rate))
            row = bench_session_transport(steps, rate, args.quality, noise)
            results[key] = {k: v for k, v in row.items() if k not in hidden}
            print(f"session transport ({content}):", json.dumps(results[key]), flush=True)
        key = f"raw_webp_256_{content}"
        frames = round(args.seconds * args.overload_rate)
        results[key] = bench_raw_transport(frames, args.quality, noise)
        print(f"raw transport ({content}):", json.dumps(results[key]), flush=True)
    # The overload runs: the engine outpaces the transport, so what arrives is its capacity.
    capacity = [v["delivered_fps"] for k, v in results.items()
                if k.endswith(f"_{args.overload_rate:g}_per_s")]
    results["session_transport_ok"] = min(capacity) >= 60
    print("session transport delivers >= 60 previews/s:", results["session_transport_ok"])
    if not args.skip_model:
        from genserve.multimodal_gen.launch import start_diffusion_client

        client = start_diffusion_client(["tiny-wan"], SimpleNamespace())
        try:
            app = create_app(GatewayConfig(max_realtime_sessions=2), [], client)
            with serve(app) as url:
                results.update(bench_latency_and_pacing(url, args))
        finally:
            asyncio.run(client.shutdown())
        for row in results["latency"]:
            print("latency:", json.dumps({k: round(v, 1) for k, v in row.items()}))
        print("latency within one step + 100 ms:", results["latency_ok"])
        print("pacing:", json.dumps(results["pacing"]))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
