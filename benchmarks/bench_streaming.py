"""Streaming video benchmark: a streaming model (Helios; `tiny-helios` by default) served by the
real diffusion worker, each stream one continuous video kept in the worker between chunks.

1. First frame: after a warm-up session, the time from a realtime `start` message (real gateway
   app on uvicorn, WebSocket client) to the first final frame; median and max of `--sessions`
   sessions.
2. Sustained: one stream making `--chunks` chunks back to back through the diffusion client (no
   playback pacing): final frames per second.
3. Memory: one stream making `--rss-chunks` chunks; the worker's RSS after a warm-up (the first
   tenth of the chunks) and at the end (growth must stay under 2%), and the stream bytes the
   worker reports.
4. Batched streams: `--streams` streams running at once (their chunks share transformer calls)
   against the same streams run one after another, `--batch-chunks` chunks each; frame
   throughput of both, measured side by side, and their ratio (target >= 2.5x for 4 streams).

Usage: python benchmarks/bench_streaming.py [--model tiny-helios|FOLDER] [--size 64x64] [--steps 2]
       [--prompt TEXT]
       [--chunks 50] [--rss-chunks 200] [--streams 4] [--batch-chunks 6] [--device auto]
       [--json out.json]
       python benchmarks/bench_streaming.py --smoke   # every part at a toy size: checks it
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from genserve.multimodal_gen.messages import DiffusionRequest, ErrorEvent, ResultEvent  # noqa: E402


def _request(args, stream_id: str, chunk: int, seed: int) -> DiffusionRequest:
    width, height = (int(v) for v in args.size.split("x"))
    return DiffusionRequest(
        rid=f"{stream_id}-{chunk}", model=args.model, prompt=args.prompt,
        width=width, height=height, num_inference_steps=args.steps, seed=seed,
        progress=False, stream_id=stream_id, stream_reset=chunk == 0)


async def _chunk(client, req: DiffusionRequest) -> int:
    async for event in client.stream(req):
        if isinstance(event, ErrorEvent):
            raise RuntimeError(f"chunk {req.rid} failed: {event.message}")
        if isinstance(event, ResultEvent):
            return len(event.outputs[0])
    raise RuntimeError("the stream ended without a result")


async def _run_stream(client, args, stream_id: str, chunks: int, seed: int,
                      after_chunk=None) -> int:
    frames = 0
    for k in range(chunks):
        frames += await _chunk(client, _request(args, stream_id, k, seed))
        if after_chunk is not None:
            after_chunk(k)
    await client.end_stream(stream_id)
    return frames


def _worker_rss(client) -> int:
    import psutil

    return psutil.Process(client.runtime_report()["pid"]).memory_info().rss


async def _sustained(client, args) -> dict:
    await _run_stream(client, args, "warm", 2, 1)
    t0 = time.perf_counter()
    frames = await _run_stream(client, args, "sustained", args.chunks, 2)
    seconds = time.perf_counter() - t0
    return {"chunks": args.chunks, "frames": frames, "seconds": round(seconds, 3),
            "frames_per_s": round(frames / seconds, 2)}


async def _memory(client, args) -> dict:
    warm_after = max(1, args.rss_chunks // 10)
    samples: dict[str, int] = {}
    peak_bytes = 0

    def sample(k: int) -> None:
        nonlocal peak_bytes
        peak_bytes = max(peak_bytes, client.stream_stats()["stream_bytes"])
        if k + 1 == warm_after:
            samples["warm"] = _worker_rss(client)

    await _run_stream(client, args, "memory", args.rss_chunks, 3, after_chunk=sample)
    samples["end"] = _worker_rss(client)
    growth = (samples["end"] - samples["warm"]) / samples["warm"]
    return {"chunks": args.rss_chunks, "rss_after_warmup_mb": round(samples["warm"] / 2**20, 1),
            "rss_end_mb": round(samples["end"] / 2**20, 1),
            "rss_growth_pct": round(100 * growth, 2), "stream_bytes": peak_bytes}


async def _batched(client, args) -> dict:
    n, k = args.streams, args.batch_chunks
    t0 = time.perf_counter()
    frames = 0
    for i in range(n):
        frames += await _run_stream(client, args, f"seq{i}", k, 10 + i)
    sequential_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    together = await asyncio.gather(*(_run_stream(client, args, f"par{i}", k, 10 + i)
                                      for i in range(n)))
    concurrent_s = time.perf_counter() - t0
    seq_fps, par_fps = frames / sequential_s, sum(together) / concurrent_s
    return {"streams": n, "chunks_each": k, "sequential_frames_per_s": round(seq_fps, 2),
            "concurrent_frames_per_s": round(par_fps, 2),
            "speedup": round(par_fps / seq_fps, 2)}


def _first_frame(client, args) -> dict:
    from genserve.entrypoints.app import create_app
    from genserve.entrypoints.config import GatewayConfig
    from tests.realtime.client import run_session
    from tests.realtime.server import serve

    width, height = (int(v) for v in args.size.split("x"))
    start = dict(model=args.model, prompt=args.prompt, width=width, height=height,
                 num_inference_steps=args.steps, fps=120, seed=1, continuous=True,
                 max_chunks=1)
    finals = []
    with serve(create_app(GatewayConfig(), [], client)) as base:
        asyncio.run(run_session(base, start, timeout_s=600))  # warm-up
        for _ in range(args.sessions):
            out = asyncio.run(run_session(base, start, timeout_s=600))
            if not out.finals:
                raise RuntimeError(f"the session made no frame: {out.messages[-2:]}")
            finals.append(1e3 * (out.final_times[0] - out.start_sent_at))
    return {"sessions": args.sessions, "first_final_ms_median": round(statistics.median(finals), 1),
            "first_final_ms_max": round(max(finals), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-helios",
                        help="a served name or a trained folder (a shapes-stream export)")
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--prompt", default="a red circle moving right on a black background",
                        help="the streams' prompt (the shapes grammar suits shapes-stream)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=50)
    parser.add_argument("--rss-chunks", type=int, default=200)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--batch-chunks", type=int, default=6)
    parser.add_argument("--sessions", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--smoke", action="store_true",
                        help="1 step, 2 chunks, 2 streams of 1 chunk, 1 session: checks it")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.chunks, args.rss_chunks, args.batch_chunks = 1, 2, 2, 1
        args.streams, args.sessions = 2, 1

    from genserve.multimodal_gen.launch import start_diffusion_client

    client = start_diffusion_client([args.model], SimpleNamespace(
        device=args.device, diffusion_max_batch_size=max(4, args.streams)))
    path, args.model = args.model, client.specs()[0].name  # a folder serves as its own name
    spec = client.model_spec(args.model)
    results = {"model": path, "size": args.size, "steps": args.steps,
               "chunk_frames": spec.default_num_frames}
    try:
        results["first_frame"] = _first_frame(client, args)
        print(json.dumps({"first_frame": results["first_frame"]}), flush=True)
        results["sustained"] = asyncio.run(_sustained(client, args))
        print(json.dumps({"sustained": results["sustained"]}), flush=True)
        results["memory"] = asyncio.run(_memory(client, args))
        print(json.dumps({"memory": results["memory"]}), flush=True)
        results["batched"] = asyncio.run(_batched(client, args))
        print(json.dumps({"batched": results["batched"]}), flush=True)
    finally:
        asyncio.run(client.shutdown())
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
