"""Mixed soak: a real `genserve serve` under every kind of traffic at once, for a while.

    python benchmarks/soak.py --duration 600          # the 10-minute soak
    python benchmarks/soak.py --duration 60 --json    # a quick one
    python benchmarks/soak.py --smoke                 # 20 s of traffic: checks the script

Starts `genserve serve` on loopback (embedded SmolLM2, the demo diffusion models) and runs, side
by side until --duration ends: LLM chat streams (some dropped by the client after a few chunks),
image generations, video jobs (some cancelled while they run, the others downloaded) and realtime
WebSocket sessions (most dropped before they end). It records the resident memory of every
process after --warmup seconds and at the end, and fails (exit status 1) when a process grew by
more than --max-rss-growth percent, when a request was lost (no result and no error: a stream
cut short by the server, a job that never ended, a transport error), or when the server is not
intact afterwards (health, restarts, integrity checks of the pools).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import time
from typing import Any

import httpx
import websockets

from genserve.bench.server_process import (
    ROBUSTNESS_FLAGS,
    ServerProcess,
    serve,
    server_problems,
)

PROMPTS = ("Tell me about the sea.", "What is the capital of France?", "Write a haiku about rain.",
           "List three colours.", "Why is the sky blue?")
SHAPE_PROMPTS = ("a red circle on a white background", "a blue square moving right",
                 "a green triangle on a black background")


class Tally:
    """Outcomes per traffic kind: ok, error (an HTTP / in-band error the client was told
    about), dropped (the client went away on purpose), lost (anything else)."""

    def __init__(self) -> None:
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.lost: list[str] = []
        self.errors: list[str] = []  # a few examples

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        self.counts[kind][outcome] += 1
        if outcome == "lost":
            self.lost.append(f"{kind}: {detail}"[:300])
        elif outcome == "error" and len(self.errors) < 20:
            self.errors.append(f"{kind}: {detail}"[:300])


async def llm_stream(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    models = (await http.get("/v1/models")).json()["data"]
    model = next(m["id"] for m in models if m["kind"] == "llm")
    body = {"model": model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "stream": True,
            "max_tokens": rng.randint(8, 64), "temperature": 0.7, "seed": rng.randint(0, 9999)}
    drop_after = rng.randint(1, 4) if rng.random() < 0.3 else None
    chunks, done = 0, False
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            tally.add("llm", "error" if "error" in response.text else "lost", response.text)
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            if '"error"' in line:
                tally.add("llm", "error", line)
                return
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                tally.add("llm", "dropped")
                return  # leaving the block closes the connection mid-stream
    tally.add("llm", "ok" if done else "lost", "" if done else f"stream ended after {chunks}")


async def image(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    body = {"model": "shapes-image", "prompt": rng.choice(SHAPE_PROMPTS), "size": "64x64",
            "n": rng.randint(1, 2), "num_inference_steps": rng.randint(4, 12),
            "response_format": "b64_json"}
    response = await http.post("/v1/images/generations", json=body)
    if response.status_code == 200 and len(response.json()["data"]) == body["n"]:
        tally.add("image", "ok")
    else:
        tally.add("image", "error" if "error" in response.text else "lost", response.text)


async def video(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    body = {"model": "shapes-video", "prompt": rng.choice(SHAPE_PROMPTS), "size": "32x32",
            "num_inference_steps": rng.randint(8, 24)}
    response = await http.post("/v1/videos", json=body)
    if response.status_code != 200:
        tally.add("video", "error" if "error" in response.text else "lost", response.text)
        return
    job = response.json()["id"]
    cancel = rng.random() < 0.3
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status = (await http.get(f"/v1/videos/{job}")).json()
        if cancel and status["status"] in ("queued", "in_progress"):
            await http.delete(f"/v1/videos/{job}")
            cancel = False
            continue
        if status["status"] == "completed":
            content = await http.get(f"/v1/videos/{job}/content")
            ok = content.status_code == 200 and content.content[4:8] == b"ftyp"
            tally.add("video", "ok" if ok else "lost", f"content {content.status_code}")
            await http.delete(f"/v1/videos/{job}")
            return
        if status["status"] in ("cancelled", "failed"):
            kind = "dropped" if status["status"] == "cancelled" else "error"
            tally.add("video", kind, json.dumps(status))
            await http.delete(f"/v1/videos/{job}")
            return
        await asyncio.sleep(0.2)
    tally.add("video", "lost", f"job {job} never ended")


async def realtime(ws_url: str, rng: random.Random, tally: Tally) -> None:
    start = {"type": "start", "model": "shapes-video", "prompt": rng.choice(SHAPE_PROMPTS),
             "width": 32, "height": 32, "num_inference_steps": rng.randint(4, 8),
             "preview_format": rng.choice(("webp", "jpeg", "rgb")), "fps": 16}
    drop_after = rng.randint(1, 6) if rng.random() < 0.7 else None
    messages = 0
    async with websockets.connect(ws_url + "/v1/realtime/video", max_size=None) as ws:
        await ws.send(json.dumps(start))
        while True:
            data = await asyncio.wait_for(ws.recv(), 120)
            messages += 1
            if drop_after is not None and messages >= drop_after:
                tally.add("realtime", "dropped")
                return  # the socket closes under a running session
            if isinstance(data, bytes):
                continue
            msg = json.loads(data)
            if msg["type"] == "error":
                # The session limit is a clear error too: the socket stays usable.
                tally.add("realtime", "error", msg.get("message", ""))
                return
            if msg["type"] == "done":
                tally.add("realtime", "ok")
                return


async def lane(name: str, job: Any, until: float, rng: random.Random, tally: Tally,
               runs: int | None = None) -> None:
    """Run `job` back to back until `until` (or `runs` times, when given); an exception is a
    lost request."""
    done = 0
    while time.monotonic() < until and (runs is None or done < runs):
        done += 1
        try:
            await job(rng, tally)
        except Exception as exc:
            tally.add(name, "lost", f"{type(exc).__name__}: {exc}")
        await asyncio.sleep(0.05)  # a refused request must not turn into a busy loop


async def traffic(server: ServerProcess, duration: float, warmup: float, seed: int,
                  lanes: int, per_lane: int | None = None) -> dict[str, Any]:
    """Every kind of traffic side by side for `duration` seconds; with `per_lane`, each lane
    stops after that many requests (whichever comes first): a lane's random choices (which
    streams are dropped, which jobs cancelled) then depend on `seed` alone, not on the
    machine's speed."""
    tally = Tally()
    rng = random.Random(seed)
    ws_url = server.url.replace("http://", "ws://")
    t0 = time.monotonic()
    until = t0 + duration
    rss: dict[str, dict[str, float]] = {}

    async def sample_after_warmup() -> None:
        await asyncio.sleep(warmup)
        rss["after_warmup"] = await asyncio.to_thread(server.rss_mib)

    timeout = httpx.Timeout(300.0)
    async with httpx.AsyncClient(base_url=server.url, timeout=timeout) as http:
        jobs = {
            "llm": lambda r, t: llm_stream(http, r, t),
            "image": lambda r, t: image(http, r, t),
            "video": lambda r, t: video(http, r, t),
            "realtime": lambda r, t: realtime(ws_url, r, t),
        }
        tasks = [lane(name, job, until, random.Random(rng.random()), tally, per_lane)
                 for name, job in jobs.items() for _ in range(lanes)]
        await asyncio.gather(sample_after_warmup(), *tasks)
    rss["end"] = await asyncio.to_thread(server.rss_mib)
    return {"seconds": round(time.monotonic() - t0, 1), "rss_mib": rss,
            "outcomes": {k: dict(v) for k, v in sorted(tally.counts.items())},
            "lost": tally.lost[:20], "lost_count": len(tally.lost), "errors": tally.errors}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="Seconds of traffic.")
    p.add_argument("--warmup", type=float, default=None,
                   help="RSS baseline after this many seconds (default: a fifth of --duration).")
    p.add_argument("--lanes", type=int, default=1, help="Concurrent clients per traffic kind.")
    p.add_argument("--max-rss-growth", type=float, default=5.0, help="Percent, per process.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--smoke", action="store_true", help="20 s of traffic, RSS after 5 s")
    args = p.parse_args()
    if args.smoke:
        args.duration, args.warmup = 20.0, 5.0
    warmup = args.duration / 5 if args.warmup is None else args.warmup
    with serve(*ROBUSTNESS_FLAGS) as server:
        result = asyncio.run(traffic(server, args.duration, warmup, args.seed, args.lanes))
        result["integrity_problems"] = server_problems(server.url)
        result["restarts"] = {name: r.get("restarts", 0) for name, r in httpx.get(
            server.url + "/health", timeout=30).json()["runtimes"].items()}
    before, after = result["rss_mib"]["after_warmup"], result["rss_mib"]["end"]
    result["rss_growth_percent"] = {
        name: round(100 * (after[name] - before[name]) / before[name], 2)
        for name in before if name in after}
    grew = {n: g for n, g in result["rss_growth_percent"].items() if g > args.max_rss_growth}
    ok = not grew and not result["lost_count"] and not result["integrity_problems"]
    result["ok"] = ok
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['seconds']} s: outcomes {result['outcomes']}")
        for name in before:
            print(f"  {name:>24}: RSS {before[name]:8.1f} MiB after warm-up, "
                  f"{after.get(name, float('nan')):8.1f} MiB at the end "
                  f"({result['rss_growth_percent'].get(name, float('nan')):+.2f}%)")
        print(f"lost: {result['lost_count']} {result['lost'][:5]}")
        print(f"integrity: {result['integrity_problems'] or 'intact'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
