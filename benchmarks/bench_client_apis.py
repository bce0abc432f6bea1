"""The client API shapes side by side (issue 32): the same 64 chat requests (greedy,
max 32 new tokens, 8 at a time) through `/v1/responses`, `/v1/messages`, `/api/chat` and
`/v1/chat/completions` of one real `genserve serve` (the embedded SmolLM2-135M-Instruct,
float32, no diffusion), in interleaved rounds: each round runs every path once, in a rotated
order, with the prefix cache flushed before each pass so that no path reuses another's prompts.

Prints, per path, the requests and output tokens per second (summed over the rounds), its
throughput ratio to chat completions, and whether its answers equal chat completions' (greedy,
so they must).

    python benchmarks/bench_client_apis.py [--requests 64] [--concurrency 8] [--rounds 3]
                                           [--max-tokens 32]
    python benchmarks/bench_client_apis.py --smoke   # a tiny random model: checks the script
    python benchmarks/bench_client_apis.py --url URL   # a running server (no API key) instead
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.needs import smollm2_folder  # noqa: E402
from tests.serve_process import serve_process  # noqa: E402

TOPICS = ["the sea", "a city", "winter", "a library", "coffee", "trains", "a garden", "music"]


def questions(n: int) -> list[str]:
    return [f"Write one sentence about {TOPICS[k % 8]} and the number {k}." for k in range(n)]


# Each path: (route, request body for (model, question, max new tokens), (answer text, output
# tokens) of a reply).
ApiPath = tuple[str, Callable[[str, str, int], dict[str, Any]],
              Callable[[dict[str, Any]], tuple[str, int]]]
PATHS: dict[str, ApiPath] = {
    "chat_completions": (
        "/v1/chat/completions",
        lambda model, q, n: {"model": model, "messages": [{"role": "user", "content": q}],
                             "max_tokens": n, "temperature": 0},
        lambda r: (r["choices"][0]["message"]["content"], r["usage"]["completion_tokens"])),
    "responses": (
        "/v1/responses",
        lambda model, q, n: {"model": model, "input": [{"role": "user", "content": q}],
                             "max_output_tokens": n, "temperature": 0, "store": False},
        lambda r: ("".join(p["text"] for item in r["output"] if item["type"] == "message"
                           for p in item["content"]), r["usage"]["output_tokens"])),
    "messages": (
        "/v1/messages",
        lambda model, q, n: {"model": model, "messages": [{"role": "user", "content": q}],
                             "max_tokens": n, "temperature": 0},
        lambda r: (r["content"][0]["text"], r["usage"]["output_tokens"])),
    "ollama_chat": (
        "/api/chat",
        lambda model, q, n: {"model": model, "messages": [{"role": "user", "content": q}],
                             "stream": False,
                             "options": {"num_predict": n, "temperature": 0}},
        lambda r: (r["message"]["content"], r["eval_count"])),
}


async def run_pass(http: httpx.AsyncClient, model: str, name: str, qs: list[str],
                   concurrency: int, max_tokens: int) -> tuple[float, int, list[str]]:
    """(seconds, output tokens, answers) of the questions through one path."""
    route, build, read = PATHS[name]
    gate = asyncio.Semaphore(concurrency)
    answers: list[str] = [""] * len(qs)
    tokens = 0

    async def one(k: int) -> None:
        nonlocal tokens
        async with gate:
            r = await http.post(route, json=build(model, qs[k], max_tokens))
            r.raise_for_status()
            answers[k], n = read(r.json())
            tokens += n

    (await http.post("/flush_cache")).raise_for_status()
    start = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(len(qs))))
    return time.perf_counter() - start, tokens, answers


async def bench(url: str, args: argparse.Namespace) -> dict[str, Any]:
    qs = questions(args.requests)
    names = list(PATHS)
    seconds = dict.fromkeys(names, 0.0)
    tokens = dict.fromkeys(names, 0)
    answers: dict[str, list[str]] = {}
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for name in names:  # warm-up: every path once, a few requests
            await run_pass(http, model, name, qs[:args.concurrency], args.concurrency,
                           args.max_tokens)
        for r in range(args.rounds):
            for name in names[r % 4:] + names[:r % 4]:
                s, n, a = await run_pass(http, model, name, qs, args.concurrency,
                                         args.max_tokens)
                seconds[name] += s
                tokens[name] += n
                answers.setdefault(name, a)
    base = args.rounds * args.requests / seconds["chat_completions"]
    result = {}
    for name in names:
        rps = args.rounds * args.requests / seconds[name]
        same = sum(a == b for a, b in zip(answers[name], answers["chat_completions"],
                                           strict=True))
        result[name] = {"requests_per_s": round(rps, 3),
                        "output_tokens_per_s": round(tokens[name] / seconds[name], 1),
                        "ratio_to_chat_completions": round(rps / base, 3),
                        "answers_equal_chat": f"{same}/{args.requests}"}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32, help="max new tokens a request")
    parser.add_argument("--model-path", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--url", default=None,
                        help="measure this running server (no API key) instead of starting one")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny random model, 2 requests of 4 tokens, 1 round: checks the "
                        "script")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.concurrency, args.rounds, args.max_tokens = 2, 2, 1, 4
    if args.url:
        result = asyncio.run(bench(args.url, args))
    else:
        if args.smoke:
            from genserve.bench.tiny import tiny_chat_model

            args.model_path = args.model_path or str(tiny_chat_model())
        model = args.model_path or str(smollm2_folder())
        with serve_process("--model-path", model, "--max-total-tokens", "8192") as url:
            result = asyncio.run(bench(url, args))
    print(json.dumps({"requests": args.requests, "concurrency": args.concurrency,
                      "rounds": args.rounds, "max_tokens": args.max_tokens, "paths": result},
                     indent=2))


if __name__ == "__main__":
    main()
