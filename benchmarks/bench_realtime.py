"""Realtime video benchmark (the protocol: docs/realtime_protocol.md).

1. First-preview latency: after a warm-up session, the time from sending `start` to the first
   preview frame, against the budget of one denoising step + 100 ms (the step time is the median
   gap between previews of the same session).
2. Transport throughput: 256x256 WebP frames encoded (the server's encoder, WebP method 0), sent
   over a real uvicorn WebSocket, received by a `websockets` client and decoded with Pillow,
   frames/s (target >= 60).
3. Final-frame pacing: arrival gaps of a session's final frames against 1/fps.

Runs the real diffusion worker with the embedded tiny video model (`tiny-wan`) on this machine.
Usage: python benchmarks/bench_realtime.py [--sessions 3] [--transport-frames 300] [--fps 24]
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


def bench_transport(num_frames: int, quality: int, noise: float) -> dict:
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
    parser.add_argument("--sessions", type=int, default=3, help="measured latency sessions")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per session")
    parser.add_argument("--fps", type=int, default=24, help="fps of the pacing session")
    parser.add_argument("--transport-frames", type=int, default=300)
    parser.add_argument("--quality", type=int, default=80)
    parser.add_argument("--skip-model", action="store_true",
                        help="only the transport benchmark (no diffusion worker)")
    args = parser.parse_args()

    results: dict = {}
    for content, noise in (("smooth", 0.0), ("noisy", 25.0)):
        key = f"transport_webp_256_{content}"
        results[key] = bench_transport(args.transport_frames, args.quality, noise)
        print(f"transport ({content}):", json.dumps(results[key]), flush=True)
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
