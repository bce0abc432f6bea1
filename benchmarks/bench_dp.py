"""Data parallel behind sglang-router: router overhead and cache-aware routing.

1. Overhead: the same workload (concurrent /v1/completions) sent to one replica directly and
   through the router in front of it, alternating A/B rounds; output tok/s and the ratio
   (target >= 0.9x).
2. Routing: two replicas, a shared-prefix workload (P system prompts, Q questions each, sent in
   an order that splits each prompt's questions), prefix-cache hit rate (cached / prompt
   tokens, from the replicas' `meta_info`) with `cache_aware` and with `round_robin`.

Replicas are `genserve serve --no-diffusion` on loopback ports (SmolLM2 by default).
Usage: python benchmarks/bench_dp.py [--requests 32] [--concurrency 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

from genserve.entrypoints.data_parallel import router_command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ok(url: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready")


@contextlib.contextmanager
def replica(flags: list[str]) -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--no-diffusion",
         "--port", str(port), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ok(url + "/health")
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


@contextlib.contextmanager
def router(replicas: list[str], policy: str) -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(router_command("127.0.0.1", port, replicas, policy),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, KeyError):
                workers = httpx.get(url + "/workers", timeout=2).json()["workers"]
                if len(workers) == len(replicas) and all(w["is_healthy"] for w in workers):
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError("router did not see its replicas")
        yield url
    finally:
        proc.terminate()
        proc.wait(15)


def _served_model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


async def _throughput(
    url: str, model: str, requests: int, concurrency: int, max_tokens: int
) -> float:
    """Output tokens per second of `requests` completions, `concurrency` at a time."""
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(http: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens
        async with sem:
            r = await http.post(url + "/v1/completions", json={
                "model": model, "prompt": f"Story {i}: once upon a time",
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(http, i) for i in range(requests)))
        return tokens / (time.perf_counter() - t0)


def bench_overhead(args: argparse.Namespace, flags: list[str]) -> dict:
    with replica(flags) as direct, router([direct], "round_robin") as routed:
        model = _served_model(direct)
        asyncio.run(_throughput(direct, model, 4, 4, 4))  # warm-up
        ratios, rows = [], []
        for _ in range(args.rounds):
            a = asyncio.run(
                _throughput(direct, model, args.requests, args.concurrency, args.tokens)
            )
            b = asyncio.run(
                _throughput(routed, model, args.requests, args.concurrency, args.tokens)
            )
            ratios.append(b / a)
            rows.append({"direct_tok_s": round(a, 1), "router_tok_s": round(b, 1)})
    return {"rounds": rows, "median_ratio": round(statistics.median(ratios), 3),
            "target": 0.9, "ok": statistics.median(ratios) >= 0.9}


def _hit_rate(url: str, prefixes: int, questions: int) -> float:
    systems = [f"System prompt {k}. " + " ".join(
        f"Guideline {k}.{i}: stay on topic {k * 13 + i} and be brief." for i in range(24))
        for k in range(prefixes)]
    cached = prompt = 0
    with httpx.Client(timeout=600) as http:
        for q0 in range(0, questions, 2):
            for k, system in enumerate(systems):
                for q in (q0, q0 + 1):
                    r = http.post(url + "/generate", json={
                        "text": f"{system}\nQuestion {q}: what is {k} times {q}?",
                        "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
                    r.raise_for_status()
                    meta = r.json()["meta_info"]
                    cached += meta["cached_tokens"]
                    prompt += meta["prompt_tokens"]
    return cached / prompt


def bench_routing(args: argparse.Namespace, flags: list[str]) -> dict:
    out = {}
    with replica(flags) as a, replica(flags) as b:
        for policy in ("round_robin", "cache_aware"):
            for url in (a, b):
                httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
            with router([a, b], policy) as routed:
                out[policy] = round(_hit_rate(routed, args.prefixes, args.questions), 3)
    return {"hit_rate": out, "prefixes": args.prefixes, "questions": args.questions}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--model-path", default=None)
    args = p.parse_args()
    flags = ["--num-threads", str(args.threads), "--dtype", "float32"]
    if args.model_path:
        flags += ["--model-path", args.model_path]
    results = {"overhead": bench_overhead(args, flags), "routing": bench_routing(args, flags)}
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
