"""Data parallel behind sglang-router: router overhead and cache-aware routing.

1. Overhead: the same workload (concurrent /v1/completions) sent to one replica directly and
   through the router in front of it, in rounds that alternate which side goes first, with the
   replica's prefix cache flushed before each pass (neither side gets the other's cache hits);
   output tok/s and the median ratio (target >= 0.9x).
2. Routing: two replicas, a shared-prefix workload (P system prompts, Q questions each, sent in
   an order that splits each prompt's questions), prefix-cache hit rate (cached / prompt
   tokens, from the replicas' `meta_info`) with `cache_aware` and with `round_robin`.

Replicas are `genserve serve --no-diffusion --dtype float32 --quantization none --no-compile`
on loopback ports (SmolLM2 by default; the mode is pinned: `auto` may pick per start).
Usage: python benchmarks/bench_dp.py [--requests 32] [--concurrency 8] [--rounds 4]
       python benchmarks/bench_dp.py --smoke    # a tiny random model: checks the script
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


def _flush(*urls: str) -> None:
    for url in urls:
        httpx.post(url + "/flush_cache", timeout=60).raise_for_status()


def bench_overhead(args: argparse.Namespace, direct: str) -> dict:
    with router([direct], "round_robin") as routed:
        model = _served_model(direct)
        asyncio.run(_throughput(direct, model, 4, 4, 4))  # warm-up
        sides = {"direct": direct, "router": routed}
        ratios, rows = [], []
        for r in range(args.rounds):
            order = ["direct", "router"] if r % 2 == 0 else ["router", "direct"]
            tok_s = {}
            for side in order:
                _flush(direct)  # the router's replica: no pass reuses the other's prompts
                tok_s[side] = asyncio.run(_throughput(sides[side], model, args.requests,
                                                      args.concurrency, args.tokens))
            ratios.append(tok_s["router"] / tok_s["direct"])
            rows.append({"first": order[0], "direct_tok_s": round(tok_s["direct"], 1),
                         "router_tok_s": round(tok_s["router"], 1)})
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


def bench_routing(args: argparse.Namespace, a: str, b: str) -> dict:
    out = {}
    for policy in ("round_robin", "cache_aware"):
        _flush(a, b)
        with router([a, b], policy) as routed:
            out[policy] = round(_hit_rate(routed, args.prefixes, args.questions), 3)
    return {"hit_rate": out, "prefixes": args.prefixes, "questions": args.questions}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4, help="overhead rounds (even: each side "
                   "goes first as often)")
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--quantization", default="none",
                   help="the replicas' --quantization (pinned: `auto` may pick per start)")
    p.add_argument("--model-path", default=None)
    p.add_argument("--smoke", action="store_true",
                   help="a tiny random model, 2 requests of 2 tokens, 2 rounds, 2 x 2 prompts")
    args = p.parse_args()
    if args.smoke:
        from genserve.bench.tiny import tiny_chat_model

        args.model_path = args.model_path or str(tiny_chat_model())
        args.requests = args.concurrency = args.tokens = args.rounds = 2
        args.prefixes = args.questions = 2
    flags = ["--num-threads", str(args.threads), "--dtype", "float32",
             "--quantization", args.quantization, "--no-compile"]
    if args.model_path:
        flags += ["--model-path", args.model_path]
    # Both parts share the two replicas (each start costs tens of seconds on a CPU); the
    # overhead part uses the first one alone.
    with replica(flags) as a, replica(flags) as b:
        results = {"quantization": args.quantization, "overhead": bench_overhead(args, a),
                   "routing": bench_routing(args, a, b)}
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
