"""Co-scheduling benchmark: one realtime stream beside chat streams and an image burst.

Starts a real `genserve serve` (the default models: SmolLM2 + shapes-vl, shapes-image +
shapes-video; `--quantization` pinned) and measures, side by side in one run:

  (a) realtime alone: a continuous realtime session (shapes-video); the gaps between the final
      frames it delivers;
  (b) chat alone: rounds of `--chat-streams` concurrent streamed chat completions; TTFT p50/p95;
  (c) images alone: bursts of `--images` concurrent image requests (shapes-image), back to
      back for `--seconds`; images/s;
  (d) all three together: the realtime session runs while the chat rounds and the image
      bursts run beside it for `--seconds` (the stream starts `--warmup` s earlier).

It prints a table and the three ratios against the targets of issue 35 (the realtime stream's
p99 frame gap together <= 1.5x its p99 gap alone; chat TTFT p95 <= 1.3x alone; image
throughput >= 0.8x alone), then one JSON line.

Usage: python benchmarks/bench_coschedule.py [--seconds 20] [--chat-streams 8] [--images 16]
       python benchmarks/bench_coschedule.py --smoke [--url URL]   # toy sizes: checks the shape
`--url` measures a running server instead of starting one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time

import httpx
import websockets

from genserve.entrypoints.realtime.frames import FrameKind, decode_frame

TARGETS = {"realtime_gap_ratio": 1.5, "chat_ttft_ratio": 1.3, "image_rate_ratio": 0.8}


def log(msg: str) -> None:
    print(f"[bench_coschedule] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of `values`; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


async def realtime_stream(url: str, start: dict, stop: asyncio.Event, timeout: float) -> dict:
    """A continuous realtime session until `stop`: the gaps (s) between its final frames.

    Any wait for the server longer than `timeout` (connecting, a frame, the `done` after
    `stop`) is an error, not a hang."""
    ws_url = url.replace("http://", "ws://") + "/v1/realtime/video"
    finals: list[float] = []
    async with asyncio.timeout(timeout):
        ws = await websockets.connect(ws_url, max_size=None, open_timeout=timeout, close_timeout=5)
    try:
        await ws.send(json.dumps({"type": "start", **start, "continuous": True}))
        stopping = False
        last = time.perf_counter()  # the last message from the server
        while True:
            if stop.is_set() and not stopping:
                await ws.send(json.dumps({"type": "stop"}))
                stopping, last = True, time.perf_counter()
            try:
                data = await asyncio.wait_for(ws.recv(), 0.5)
            except TimeoutError:
                if time.perf_counter() - last > timeout:
                    state = "the done after stop" if stopping else "a frame"
                    raise RuntimeError(f"realtime: no message for {timeout} s ({state})") from None
                continue
            last = time.perf_counter()
            if isinstance(data, bytes):
                header, _ = decode_frame(data)
                if header.kind == FrameKind.FINAL and not stopping:
                    finals.append(last)
                continue
            msg = json.loads(data)
            if msg["type"] == "error":
                raise RuntimeError(f"realtime: {msg.get('code')}: {msg.get('message')}")
            if msg["type"] == "done" and stopping:
                break
            if msg["type"] == "done":  # the server ended the run before `stop`
                raise RuntimeError(f"realtime: the run ended before stop: {msg}")
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await ws.close()
    gaps = [b - a for a, b in zip(finals, finals[1:])]
    return {
        "frames": len(finals),
        "gap_p50_ms": pct(gaps, 50) * 1e3,
        "gap_p99_ms": pct(gaps, 99) * 1e3,
        "gap_max_ms": max(gaps, default=float("nan")) * 1e3,
    }


async def chat_one(client: httpx.AsyncClient, model: str, max_tokens: int, i: int) -> float:
    """One streamed chat completion: seconds to its first content token."""
    body = {
        "model": model,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"Tell me a short story about robot {i}."}],
    }
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if ttft is None and delta.get("content"):
                ttft = time.perf_counter() - t0
    return ttft if ttft is not None else time.perf_counter() - t0


async def chat_rounds(
    url: str,
    model: str,
    streams: int,
    max_tokens: int,
    stop: asyncio.Event,
    timeout: float,
    min_rounds: int = 1,
) -> dict:
    """Rounds of `streams` concurrent chats until `stop` (at least `min_rounds`); a chat that
    takes longer than `timeout` is an error."""
    ttfts: list[float] = []
    rounds = 0
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        while rounds < min_rounds or not stop.is_set():
            ttfts += await asyncio.gather(
                *(
                    asyncio.wait_for(chat_one(client, model, max_tokens, rounds * 100 + i), timeout)
                    for i in range(streams)
                )
            )
            rounds += 1
    return {
        "requests": len(ttfts),
        "ttft_p50_ms": pct(ttfts, 50) * 1e3,
        "ttft_p95_ms": pct(ttfts, 95) * 1e3,
    }


async def image_burst(url: str, count: int, image: dict, timeout: float) -> dict:
    """`count` image requests at once: images per second over the burst (the burst taking
    longer than `timeout` is an error)."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            resp = await client.post(
                "/v1/images/generations", json={**image, "prompt": f"a red circle {i}", "seed": i}
            )
            resp.raise_for_status()

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(count))), timeout)
        seconds = time.perf_counter() - t0
    return {"images": count, "seconds": seconds, "images_per_s": count / seconds}


async def image_bursts(
    url: str, count: int, image: dict, stop: asyncio.Event, timeout: float
) -> dict:
    """Bursts of `count` images, back to back, until `stop` (at least one): images per second
    over all of them, so the window is as long as the others' (not one short burst)."""
    images, seconds, bursts = 0, 0.0, 0
    while bursts == 0 or not stop.is_set():
        burst = await image_burst(url, count, image, timeout)
        images, seconds, bursts = images + count, seconds + burst["seconds"], bursts + 1
    return {
        "images": images,
        "bursts": bursts,
        "seconds": seconds,
        "images_per_s": images / seconds,
    }


async def _alone_realtime(url: str, start: dict, args: argparse.Namespace) -> dict:
    stop = asyncio.Event()
    task = asyncio.create_task(realtime_stream(url, start, stop, args.timeout))
    await asyncio.sleep(args.seconds)
    stop.set()
    return await task


async def _alone_chat(url: str, model: str, args: argparse.Namespace) -> dict:
    stop = asyncio.Event()
    task = asyncio.create_task(
        chat_rounds(url, model, args.chat_streams, args.max_tokens, stop, args.timeout)
    )
    await asyncio.sleep(args.seconds)
    stop.set()
    return await task


async def _together(
    url: str, model: str, start: dict, image: dict, args: argparse.Namespace
) -> dict:
    stop_rt, stop_chat = asyncio.Event(), asyncio.Event()
    rt = asyncio.create_task(realtime_stream(url, start, stop_rt, args.timeout))
    await asyncio.sleep(args.warmup)  # the stream is running before the others start
    chat = asyncio.create_task(
        chat_rounds(url, model, args.chat_streams, args.max_tokens, stop_chat, args.timeout)
    )
    images = asyncio.create_task(image_bursts(url, args.images, image, stop_chat, args.timeout))
    await asyncio.sleep(args.seconds)
    stop_chat.set()
    chat_result, images_result = await chat, await images
    stop_rt.set()  # after the load ends: the stream is measured under all of it
    return {"realtime": await rt, "chat": chat_result, "images": images_result}


async def measure(url: str, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        models = (await client.get("/v1/models")).json()["data"]
        info = (await client.get("/get_server_info")).json()
    llms = [m["id"] for m in models if m.get("kind") == "llm"]
    model = args.chat_model or llms[0]
    start = {
        "model": "shapes-video",
        "prompt": "a blue square moving right",
        "seed": 1,
        "fps": args.fps,
        "preview_format": "jpeg",
    }
    if args.realtime_steps:
        start["num_inference_steps"] = args.realtime_steps
    image = {"model": "shapes-image", "response_format": "b64_json"}
    if args.image_steps:
        image["num_inference_steps"] = args.image_steps
    log("warm-up")
    # First calls pay one-time costs (and a batch shape's first use its own): one burst and one
    # round at the sizes measured.
    await image_burst(url, args.images, image, args.timeout)
    done = asyncio.Event()
    done.set()  # one round only: a never-set event would loop forever
    await chat_rounds(url, model, args.chat_streams, args.max_tokens, done, args.timeout)
    log("realtime alone")
    alone = {"realtime": await _alone_realtime(url, start, args)}
    log("chat alone")
    alone["chat"] = await _alone_chat(url, model, args)
    log("images alone")
    stop_images = asyncio.Event()
    images = asyncio.create_task(image_bursts(url, args.images, image, stop_images, args.timeout))
    await asyncio.sleep(args.seconds)
    stop_images.set()
    alone["images"] = await images
    log("together")
    together = await _together(url, model, start, image, args)
    ratios = {
        "realtime_gap_ratio": together["realtime"]["gap_p99_ms"] / alone["realtime"]["gap_p99_ms"],
        "chat_ttft_ratio": together["chat"]["ttft_p95_ms"] / alone["chat"]["ttft_p95_ms"],
        "image_rate_ratio": together["images"]["images_per_s"] / alone["images"]["images_per_s"],
    }
    met = {
        k: (v <= TARGETS[k] if k != "image_rate_ratio" else v >= TARGETS[k])
        for k, v in ratios.items()
    }
    return {
        "chat_model": model,
        "frame_interval_ms": 1e3 / args.fps,  # the configured one; "alone" is the measured one
        "thread_split": info.get("thread_split"),
        "alone": alone,
        "together": together,
        "ratios": ratios,
        "targets": TARGETS,
        "met": met,
    }


def print_table(r: dict) -> None:
    a, t = r["alone"], r["together"]
    print(f"thread split: {r['thread_split']}")
    print(f"configured frame interval: {r['frame_interval_ms']:.0f} ms")
    print(f"{'measure':<34}{'alone':>12}{'together':>12}")
    rows = [
        ("realtime final frames", "realtime", "frames", "{:.0f}"),
        ("realtime frame gap p50 (ms)", "realtime", "gap_p50_ms", "{:.0f}"),
        ("realtime frame gap p99 (ms)", "realtime", "gap_p99_ms", "{:.0f}"),
        ("chat requests", "chat", "requests", "{:.0f}"),
        ("chat TTFT p50 (ms)", "chat", "ttft_p50_ms", "{:.0f}"),
        ("chat TTFT p95 (ms)", "chat", "ttft_p95_ms", "{:.0f}"),
        ("images per second", "images", "images_per_s", "{:.3f}"),
    ]
    for label, part, key, fmt in rows:
        print(f"{label:<34}{fmt.format(a[part][key]):>12}{fmt.format(t[part][key]):>12}")
    for key, value in r["ratios"].items():
        op = ">=" if key == "image_rate_ratio" else "<="
        verdict = "met" if r["met"][key] else "MISSED"
        print(f"{key:<34}{value:>12.2f}   target {op} {TARGETS[key]}  {verdict}")


@contextlib.contextmanager
def _server(args: argparse.Namespace):
    if args.url:
        yield args.url
        return
    from genserve.bench.server_process import serve

    flags = ["--quantization", args.quantization, "--no-compile", *args.serve_flag]
    with serve(*flags) as server:
        yield server.url


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="a running server (else one is started)")
    p.add_argument("--quantization", default="int8wo", help="pinned for the started server")
    p.add_argument("--serve-flag", action="append", default=[], help="extra serve flag")
    p.add_argument("--seconds", type=float, default=20.0, help="each 'alone' window")
    p.add_argument("--warmup", type=float, default=3.0, help="realtime lead before the load")
    p.add_argument("--chat-streams", type=int, default=8)
    p.add_argument("--chat-model", default=None)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--image-steps", type=int, default=None)
    p.add_argument("--realtime-steps", type=int, default=None)
    p.add_argument("--fps", type=int, default=8)
    p.add_argument(
        "--timeout",
        type=float,
        default=180.0,
        help="seconds any one client call may wait before it is an error",
    )
    p.add_argument("--smoke", action="store_true", help="toy sizes: checks the output shape")
    args = p.parse_args()
    if args.smoke:
        args.seconds, args.warmup, args.chat_streams, args.max_tokens = 2.0, 0.5, 2, 4
        args.images, args.image_steps, args.realtime_steps = 2, 2, 2
        args.timeout = min(args.timeout, 30.0)
    with _server(args) as url:
        result = asyncio.run(measure(url, args))
    print_table(result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
