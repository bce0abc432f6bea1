"""How much throughput the HTTP path keeps: the same shared-prefix workload through the offline
`Engine` (one process, no HTTP) and through `genserve serve`'s stack (gateway + AsyncEngine with
its scheduler process, streaming SSE), measured in one run.

    genserve bench http-vs-offline                       # 8 groups x 8, 512 + 32 tokens -> 32
    genserve bench http-vs-offline --groups 2 --per-group 4 --system-len 64 --output-len 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from genserve.bench.datasets import shared_prefix_dataset
from genserve.bench.gateway_thread import GatewayThread
from genserve.bench.serving import BenchConfig, run_benchmark, to_prompt


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="Default: the embedded SmolLM2.")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="HTTP side (default: every request at once, like the offline batch).")
    p.add_argument("--output-json", default=None)
    p.add_argument("--log-level", default="warning",
                   help="Scheduler log level of both engines (debug traces every step).")


def _offline(args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    from genserve.srt.engine import Engine
    from genserve.srt.tokenizer_manager import tokenize_prompt

    engine = Engine(args.model_path, dtype=args.dtype)
    ids = [tokenize_prompt(engine.tokenizer, t) for t in texts]
    params = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=[ids[0][:8]], sampling_params={**params, "max_new_tokens": 2})
    engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=params)
    duration = time.perf_counter() - start
    engine.shutdown()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"duration_s": duration, "request_throughput": len(outs) / duration,
            "output_throughput": tokens / duration}


# The gateway's app around one LLM runtime. The caller (the `genserve` CLI) passes it in: the
# gateway sits above this package, which only drives it.
GatewayApp = Callable[[Any], Any]


def _gateway(args: argparse.Namespace, make_app: GatewayApp) -> GatewayThread:
    """AsyncEngine + gateway + uvicorn on one event loop in a background thread."""

    async def build(runtimes: list[Any]) -> Any:
        from genserve.srt.engine import AsyncEngine
        from genserve.srt.server_args import EngineArgs

        engine = AsyncEngine(
            EngineArgs(model_path=args.model_path, dtype=args.dtype), log_level=args.log_level
        )
        runtimes.append(engine)
        return make_app(engine)

    return GatewayThread(build)


def run_from_args(args: argparse.Namespace, make_app: GatewayApp) -> int:
    import logging

    logging.basicConfig(format="%(asctime)s %(levelname)s [%(name)s] %(message)s")
    logging.getLogger("genserve").setLevel(args.log_level.upper())
    workload = shared_prefix_dataset(args.groups, args.per_group, args.system_len,
                                     args.question_len, args.output_len, seed=0)
    texts = [to_prompt(r).text for r in workload]
    offline = _offline(args, texts)
    with _gateway(args, make_app) as gateway:
        cfg = BenchConfig(backend="genserve", base_url=gateway.url, model=None, api_key=None,
                          request_rate=float("inf"), max_concurrency=args.max_concurrency,
                          warmup_requests=1, ignore_eos=True, extra={}, timeout=3600.0, seed=0)
        http = asyncio.run(run_benchmark(cfg, workload))
    result = {
        "offline": offline,
        "http": {k: http[k] for k in ("duration_s", "request_throughput", "output_throughput",
                                      "median_ttft_ms", "cache_hit_ratio", "failed")},
        "http_over_offline_output_throughput": http["output_throughput"]
        / offline["output_throughput"],
    }
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if http["failed"] == 0 else 1
