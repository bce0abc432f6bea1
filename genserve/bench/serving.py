"""Serving benchmark: `genserve bench serving --backend genserve --dataset generated-shared-prefix`.

Sends a synthetic workload to a running server over streaming HTTP at a request rate (Poisson
arrivals) and/or a concurrency cap, then reports request and token throughput, TTFT / ITL /
TPOT / E2E (mean, median, p99) and the prefix-cache hit ratio the server reports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from genserve.bench.backends import BACKENDS, Prompt, RequestResult, send_request
from genserve.bench.datasets import (
    BenchRequest,
    Conversation,
    multiturn_dataset,
    random_dataset,
    shared_prefix_dataset,
)

DATASETS = ("random", "generated-shared-prefix", "multiturn")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="genserve", choices=BACKENDS)
    p.add_argument("--base-url", default=None, help="Default: http://{host}:{port}.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None, help="Model id (default: the server's first).")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", default="random", choices=DATASETS)
    p.add_argument("--num-prompts", type=int, default=64, help="random dataset size.")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=1.0)
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=512)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--gsp-output-len", type=int, default=32)
    p.add_argument("--multiturn-conversations", type=int, default=8)
    p.add_argument("--multiturn-turns", type=int, default=4)
    p.add_argument("--multiturn-system-len", type=int, default=128)
    p.add_argument("--multiturn-turn-len", type=int, default=32)
    p.add_argument("--multiturn-output-len", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Requests (conversations) per second; inf sends all at once.")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--disable-ignore-eos", action="store_true",
                   help="Let the model stop at EOS (default: generate exactly the output len).")
    p.add_argument("--extra-request-body", default=None,
                   help="JSON object merged into every request body.")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-json", default=None, help="Write the results here.")


@dataclass(frozen=True)
class BenchConfig:
    backend: str
    base_url: str
    model: str | None
    api_key: str | None
    request_rate: float
    max_concurrency: int | None
    warmup_requests: int
    ignore_eos: bool
    extra: dict[str, Any]
    timeout: float
    seed: int

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.request_rate <= 0:
            raise ValueError(f"--request-rate must be > 0, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


def to_prompt(req: BenchRequest) -> Prompt:
    if req.system is None:
        return Prompt(req.prompt, [{"role": "user", "content": req.prompt}], req.output_len)
    messages = [{"role": "system", "content": req.system},
                {"role": "user", "content": req.prompt}]
    return Prompt(f"{req.system}\n\n{req.prompt}", messages, req.output_len)


def _conversation_prompt(conv: Conversation, history: list[tuple[str, str]], user: str
                         ) -> Prompt:
    messages = [{"role": "system", "content": conv.system}]
    text = f"System: {conv.system}\n"
    for question, answer in history:
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer}]
        text += f"User: {question}\nAssistant: {answer}\n"
    messages.append({"role": "user", "content": user})
    return Prompt(text + f"User: {user}\nAssistant:", messages, conv.output_len)


async def _resolve_model(client: httpx.AsyncClient, cfg: BenchConfig) -> str:
    if cfg.model:
        return cfg.model
    try:
        r = await client.get(cfg.base_url + "/v1/models")
        for m in r.json().get("data", []):
            if m.get("kind", "llm") == "llm":
                return m["id"]
    except (httpx.HTTPError, ValueError):
        pass
    return "default"


async def run_benchmark(cfg: BenchConfig, workload: list[BenchRequest] | list[Conversation]
                        ) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.max_concurrency or 1000,
                          max_keepalive_connections=cfg.max_concurrency or 1000)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout), limits=limits,
                                 headers=headers) as client:
        model = await _resolve_model(client, cfg)
        sem = asyncio.Semaphore(cfg.max_concurrency or 10**9)

        async def one(prompt: Prompt) -> RequestResult:
            async with sem:
                return await send_request(client, cfg.backend, cfg.base_url, model, prompt,
                                          cfg.ignore_eos, cfg.extra)

        async def conversation(conv: Conversation) -> list[RequestResult]:
            history: list[tuple[str, str]] = []
            results = []
            for user in conv.user_turns:
                result = await one(_conversation_prompt(conv, history, user))
                results.append(result)
                if not result.success:
                    break
                history.append((user, result.generated_text))
            return results

        for k in range(cfg.warmup_requests):
            warm = await one(Prompt(f"warm up {k}", [{"role": "user", "content": "hi"}], 4))
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")

        rng = random.Random(cfg.seed)
        tasks: list[asyncio.Task[Any]] = []
        start = time.perf_counter()
        for item in workload:
            if isinstance(item, Conversation):
                tasks.append(asyncio.create_task(conversation(item)))
            else:
                tasks.append(asyncio.create_task(one(to_prompt(item))))
            if cfg.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        gathered = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    results: list[RequestResult] = []
    for g in gathered:
        results.extend(g if isinstance(g, list) else [g])
    return summarize(results, duration, cfg, model)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
            f"median_{name}_ms": _pct(ms, 50), f"p99_{name}_ms": _pct(ms, 99)}


def summarize(results: list[RequestResult], duration: float, cfg: BenchConfig,
              model: str) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    prompt_known = [r for r in ok if r.prompt_tokens is not None]
    cache_known = [r for r in prompt_known if r.cached_tokens is not None]
    input_tokens = sum(r.prompt_tokens or 0 for r in prompt_known)
    output_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    cached = sum(r.cached_tokens or 0 for r in cache_known)
    cache_prompt = sum(r.prompt_tokens or 0 for r in cache_known)
    out: dict[str, Any] = {
        "backend": cfg.backend, "base_url": cfg.base_url, "model": model,
        "request_rate": cfg.request_rate, "max_concurrency": cfg.max_concurrency,
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_tokens": input_tokens if prompt_known else None,
        "output_tokens": output_tokens,
        "input_throughput": input_tokens / duration if duration and prompt_known else None,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration else 0,
        "cached_tokens": cached if cache_known else None,
        "cache_hit_ratio": cached / cache_prompt if cache_prompt else None,
    }
    out.update(_stats("ttft", [r.ttft for r in ok]))
    out.update(_stats("itl", [x for r in ok for x in r.itl]))
    out.update(_stats("tpot", tpot))
    out.update(_stats("e2e", [r.e2e for r in ok]))
    out["errors"] = sorted({r.error for r in results if not r.success})[:5]
    return out


def build_workload(args: argparse.Namespace) -> list[BenchRequest] | list[Conversation]:
    if args.dataset == "random":
        return random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, args.seed)
    if args.dataset == "generated-shared-prefix":
        return shared_prefix_dataset(args.gsp_num_groups, args.gsp_prompts_per_group,
                                     args.gsp_system_prompt_len, args.gsp_question_len,
                                     args.gsp_output_len, args.seed)
    return multiturn_dataset(args.multiturn_conversations, args.multiturn_turns,
                             args.multiturn_system_len, args.multiturn_turn_len,
                             args.multiturn_output_len, args.seed)


def print_report(r: dict[str, Any]) -> None:
    def fmt(v: Any) -> str:
        return "n/a" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    print(f"{' Serving benchmark ':=^56}")
    rows = [("Backend", r["backend"]), ("Model", r["model"]),
            ("Successful requests", r["completed"]), ("Failed requests", r["failed"]),
            ("Duration (s)", r["duration_s"]), ("Input tokens", r["input_tokens"]),
            ("Output tokens", r["output_tokens"]),
            ("Request throughput (req/s)", r["request_throughput"]),
            ("Input token throughput (tok/s)", r["input_throughput"]),
            ("Output token throughput (tok/s)", r["output_throughput"]),
            ("Prefix cache hit ratio", r["cache_hit_ratio"])]
    for name in ("ttft", "itl", "tpot", "e2e"):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {name.upper()} (ms)", r[f"{stat}_{name}_ms"]))
    for label, value in rows:
        print(f"{label:<40}{fmt(value):>16}")
    for error in r["errors"]:
        print(f"error: {error}")
    print("=" * 56)


def run_from_args(args: argparse.Namespace) -> int:
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-request-body must be a JSON object")
    cfg = BenchConfig(
        backend=args.backend, base_url=(args.base_url or f"http://{args.host}:{args.port}")
        .rstrip("/"), model=args.model, api_key=args.api_key, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, warmup_requests=args.warmup_requests,
        ignore_eos=not args.disable_ignore_eos, extra=extra, timeout=args.timeout,
        seed=args.seed)
    result = asyncio.run(run_benchmark(cfg, build_workload(args)))
    result["dataset"] = args.dataset
    print_report(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="genserve bench serving", description=__doc__)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
