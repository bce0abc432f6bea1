"""Structured-output benchmark (constrained decoding with xgrammar), side by side in one run,
on the embedded SmolLM2-135M-Instruct:

 1. JSON extraction, 64 requests (a schema with long property names, enums and nested
    objects), the same prompts greedy with jump-forward on vs off: every output validated
    against the schema, how many texts are equal on both sides, and the speed-up in
    requests/s (a fair measure only where the texts are equal) and in output characters/s
    (the per-output measure that holds where they differ).
 2. Mask cost at batch 16: the median decode step with 16 constrained requests (jump-forward
    off, so every step samples under the bitmask) vs 16 unconstrained ones.
 3. Compile cache: the same schema sent 8 times over HTTP compiles once
    (`genserve:grammar_compiles` in /metrics).

    python benchmarks/bench_structured.py [--requests 64] [--json-out result.json]
    python benchmarks/bench_structured.py --smoke    # a tiny random model: checks the script
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jsonschema  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 24},
        "customer_loyalty_tier": {"type": "string",
                                  "enum": ["bronze_member", "silver_member", "gold_member"]},
        "order_fulfillment_status": {"type": "string", "enum": [
            "awaiting_payment_confirmation", "preparing_for_shipment", "shipped_to_customer"]},
        "shipping_destination": {
            "type": "object",
            "properties": {"destination_city_name": {"type": "string", "maxLength": 20},
                           "destination_country_code": {"type": "string",
                                                        "enum": ["FR", "DE", "IT", "ES"]}},
            "required": ["destination_city_name", "destination_country_code"],
            "additionalProperties": False},
        "requires_signature_on_delivery": {"type": "boolean"},
    },
    "required": ["customer_full_name", "customer_loyalty_tier", "order_fulfillment_status",
                 "shipping_destination", "requires_signature_on_delivery"],
    "additionalProperties": False,
}
NAMES = ["Anna", "Bruno", "Chloe", "Dieter", "Elena", "Farid", "Greta", "Hugo"]
CITIES = ["Paris", "Berlin", "Rome", "Madrid", "Lyon", "Munich", "Milan", "Seville"]


def prompts(tokenizer, n: int) -> list[str]:
    out = []
    for k in range(n):
        text = (f"Extract the order as JSON. {NAMES[k % 8]} (a gold member) paid; the parcel "
                f"goes to {CITIES[(k // 8) % 8]} and needs a signature. Order #{1000 + k}.")
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 tokenize=False, add_generation_prompt=True))
    return out


def extraction(args) -> dict:
    from genserve import Engine

    results: dict = {}
    texts_out: dict[str, list[str]] = {}
    for jump in (True, False):
        engine = Engine(args.model_path, dtype="float32", max_total_tokens=32768,
                        max_running_requests=64, jump_forward=jump)
        texts = prompts(engine.tokenizer, args.requests)
        params = {"max_new_tokens": args.max_new_tokens, "temperature": 0,
                  "json_schema": json.dumps(SCHEMA)}
        engine.generate(texts[0], params)  # warm-up: compile the grammar, first forward
        engine.flush_cache()
        before = dict(engine.scheduler.stats)
        start = time.perf_counter()
        outs = engine.generate(texts, [params] * len(texts))
        seconds = time.perf_counter() - start
        for out in outs:
            if out["meta_info"]["finish_reason"]["type"] != "stop":
                raise RuntimeError(f"an output did not finish: {out['meta_info']} {out['text']!r}")
            jsonschema.validate(json.loads(out["text"]), SCHEMA)
        stats = engine.scheduler.stats
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        chars = sum(len(o["text"]) for o in outs)
        texts_out["on" if jump else "off"] = [o["text"] for o in outs]
        results["on" if jump else "off"] = {
            "seconds": seconds, "requests_per_s": len(outs) / seconds,
            "output_tokens_per_s": tokens / seconds, "output_tokens": tokens,
            "output_chars_per_s": chars / seconds,
            "forward_passes": (stats["decode_steps"] + stats["prefill_batches"]
                               - before["decode_steps"] - before["prefill_batches"]),
            "jump_forward_tokens": stats["jump_forward_tokens"] - before["jump_forward_tokens"],
            "valid_outputs": len(outs)}
        print(f"jump-forward {'on ' if jump else 'off'}: {seconds:.1f} s, "
              f"{len(outs) / seconds:.2f} req/s, {results['on' if jump else 'off']}", flush=True)
        engine.shutdown()
    equal = sum(a == b for a, b in zip(texts_out["on"], texts_out["off"], strict=True))
    results["texts_equal"] = f"{equal}/{args.requests}"
    # requests/s compares the same work only where both sides wrote the same texts; output
    # characters/s is the per-output measure either way.
    results["speedup"] = results["on"]["requests_per_s"] / results["off"]["requests_per_s"]
    results["speedup_per_output_char"] = (results["on"]["output_chars_per_s"]
                                          / results["off"]["output_chars_per_s"])
    return results


def mask_cost(args) -> dict:
    from genserve import Engine
    from genserve.srt.messages import TokenizedGenerateReq
    from genserve.srt.sampling import SamplingParams

    words = {"type": "object", "properties": {"words": {
        "type": "array", "items": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
        "minItems": 60, "maxItems": 60}}, "required": ["words"]}
    engine = Engine(args.model_path, dtype="float32", max_total_tokens=32768,
                    jump_forward=False)
    sched = engine.scheduler
    ids = engine.tokenizer.encode(prompts(engine.tokenizer, 1)[0])
    medians = {}
    for _round in range(2):  # the first round warms up (grammar compile, allocator)
        for name, extra in (("unconstrained", {"ignore_eos": True}),
                            ("constrained", {"json_schema": json.dumps(words)})):
            for k in range(args.batch):
                sched.add_request(TokenizedGenerateReq(
                    rid=f"{name}{k}", input_ids=ids + [28] * k,
                    sampling_params=SamplingParams(max_new_tokens=args.mask_tokens,
                                                   temperature=0.7, seed=k, **extra)))
            times = []
            while sched.has_work():
                full = len(sched.running) == args.batch and not sched.waiting
                start = time.perf_counter()
                sched.step()
                if full:
                    times.append(time.perf_counter() - start)
            medians[name] = statistics.median(times)
            engine.flush_cache()
    engine.shutdown()
    ratio = medians["constrained"] / medians["unconstrained"]
    print(f"decode step at batch {args.batch}: unconstrained "
          f"{medians['unconstrained'] * 1e3:.1f} ms, constrained "
          f"{medians['constrained'] * 1e3:.1f} ms (mask cost {100 * (ratio - 1):+.1f}%)",
          flush=True)
    return {"batch": args.batch, "unconstrained_step_ms": medians["unconstrained"] * 1e3,
            "constrained_step_ms": medians["constrained"] * 1e3, "mask_overhead": ratio - 1}


def compile_count(args) -> dict:
    import httpx
    import uvicorn

    from genserve.entrypoints.app import create_app
    from genserve.entrypoints.config import GatewayConfig
    from genserve.srt.engine import AsyncEngine
    from genserve.srt.server_args import EngineArgs

    box: dict = {}
    ready = threading.Event()

    async def serve() -> None:
        engine = AsyncEngine(EngineArgs(model_path=args.model_path, dtype="float32",
                                        max_total_tokens=8192))
        server = uvicorn.Server(uvicorn.Config(create_app(GatewayConfig(), [engine]),
                                               host="127.0.0.1", port=0, log_level="warning",
                                               lifespan="off"))
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.02)
        box["url"] = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        box["server"] = server
        ready.set()
        await task
        await engine.shutdown()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    ready.wait(300)
    url = box["url"]
    body = {"model": httpx.get(url + "/v1/models").json()["data"][0]["id"],
            "max_tokens": args.max_new_tokens,
            "temperature": 0, "messages": [{"role": "user", "content": "An order as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "order", "schema": SCHEMA}}}
    for _ in range(args.schema_requests):
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)
    metrics = httpx.get(url + "/metrics").text
    box["server"].should_exit = True
    thread.join(60)
    line = next(x for x in metrics.splitlines() if x.startswith("genserve:grammar_compiles{"))
    hits = next(x for x in metrics.splitlines() if x.startswith("genserve:grammar_cache_hits{"))
    result = {"requests": args.schema_requests, "compiles": float(line.split()[-1]),
              "cache_hits": float(hits.split()[-1])}
    print(f"compile cache: {result}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--mask-tokens", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=400)
    parser.add_argument("--schema-requests", type=int, default=8,
                        help="requests with the same schema for the compile cache")
    parser.add_argument("--model-path", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny random model, 2 requests, batch 2: checks the script")
    args = parser.parse_args()
    if args.smoke:
        from genserve.bench.tiny import tiny_chat_model

        args.model_path = args.model_path or str(tiny_chat_model())
        args.requests, args.batch, args.mask_tokens, args.schema_requests = 2, 2, 4, 2
    result = {"extraction": extraction(args), "mask_cost": mask_cost(args),
              "compile_cache": compile_count(args)}
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
