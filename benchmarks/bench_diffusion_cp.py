"""Context parallelism: one request's latency with `--diffusion-cp N` next to one device, and
whether the two draw the same pixels, measured side by side.

Each round starts a diffusion worker (the same code as `genserve serve`) with cp = 1, then with
cp = N, runs a warm-up request and then `--requests` seeded requests one at a time, and records
their median latency (queue to result, as the gateway sees it). On a CPU the cores this
process may use are split evenly between the ranks (torch threads = cores // cp), so both
settings use the same cores; on CUDA rank r takes GPU r. Prints per-setting latencies, the
ratio, the largest pixel difference between the settings, and a JSON summary.

Usage (CPU):  python benchmarks/bench_diffusion_cp.py [--model tiny-flux] [--size 256]
Smoke run:    python benchmarks/bench_diffusion_cp.py --smoke   # 32 px, 1 step, 1 request
GPU box:      python benchmarks/bench_diffusion_cp.py --device cuda --cp 2 \\
                  --model /models/FLUX.1-dev --size 1024 --steps 28 --requests 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import numpy as np

from genserve.multimodal_gen.engine_client import WorkerDiffusionClient
from genserve.multimodal_gen.messages import DiffusionRequest, ResultEvent
from genserve.multimodal_gen.worker import WorkerConfig


async def _one(client: WorkerDiffusionClient, req: DiffusionRequest) -> tuple[float, list]:
    t = time.perf_counter()
    events = [e async for e in client.stream(req)]
    if not isinstance(events[-1], ResultEvent):
        raise RuntimeError(f"request failed: {events[-1]}")
    return time.perf_counter() - t, events[-1].outputs


def run(cp: int, args: argparse.Namespace, threads: int) -> tuple[list[float], np.ndarray]:
    """Latencies (s) of the timed requests and the first one's pixels."""
    name = os.path.basename(args.model.rstrip("/"))
    config = WorkerConfig((args.model,), device=args.device, num_threads=threads, cp_size=cp,
                          batch_delay_ms=0.0)
    client = WorkerDiffusionClient(config)

    def req(rid: str, seed: int) -> DiffusionRequest:
        return DiffusionRequest(rid, name, "a red cat on a blue car", seed=seed,
                                width=args.size, height=args.size,
                                num_inference_steps=args.steps, progress=False)

    async def main():
        await _one(client, req("warm-up", 0))
        return [await _one(client, req(f"r{i}", 1 + i)) for i in range(args.requests)]

    try:
        timed = asyncio.run(main())
    finally:
        asyncio.run(client.shutdown())
    return [t for t, _ in timed], timed[0][1][0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-flux")
    p.add_argument("--device", default="auto")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--smoke", action="store_true",
                   help="32x32, 1 step, 1 request, 1 round: checks the script")
    args = p.parse_args()
    if args.smoke:
        args.size, args.steps, args.requests, args.rounds = 32, 1, 1, 1
    cores = len(os.sched_getaffinity(0))
    latencies: dict[int, list[float]] = {1: [], args.cp: []}
    pixels: dict[int, np.ndarray] = {}
    for _ in range(args.rounds):
        for cp in (1, args.cp):
            times, pixels[cp] = run(cp, args, max(1, cores // cp))
            latencies[cp] += times
            print(f"cp={cp}: median {statistics.median(times):.3f} s per request", flush=True)
    diff = int(np.abs(pixels[1].astype(int) - pixels[args.cp].astype(int)).max())
    summary = {
        "cores": cores,
        **vars(args),
        "cp1_s": statistics.median(latencies[1]),
        f"cp{args.cp}_s": statistics.median(latencies[args.cp]),
        "max_pixel_diff": diff,
    }
    summary[f"cp{args.cp}_speedup"] = summary["cp1_s"] / summary[f"cp{args.cp}_s"]
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
