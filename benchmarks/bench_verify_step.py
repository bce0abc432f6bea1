"""One n-gram speculative verify forward against one decode step (issue 33).

An offline Engine set up as `genserve serve` sets it up (the embedded SmolLM2-135M-Instruct
GGUF, `--quantization auto`, the compiled batch-1 decode step) prefills a P-token prompt into
a request row of its own, then times, interleaved, (a) a verify-shaped eager extend forward of
k + 1 tokens after those P tokens with logits at every position (what
`scheduler/speculative.py` runs for a lone request's chain draft), and (b) a batch-1 decode
step after the same P tokens. Building each ForwardBatch is timed apart from its forward.

    python benchmarks/bench_verify_step.py              # medians, ms
    python benchmarks/bench_verify_step.py --profile    # torch.profiler's top ops of the verify
    python benchmarks/bench_verify_step.py --rows       # also the verify as compiled decode rows
    python benchmarks/bench_verify_step.py --smoke      # float32, no quantization/compile

Run it with OMP_NUM_THREADS=1 for the one-thread figures of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import time

import torch
from bench_decode_step import (  # the script's folder is on sys.path
    add_engine_args,
    parse_engine_args,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    p.add_argument("--draft", type=int, default=4, help="draft tokens k (the verify feeds k+1)")
    p.add_argument("--iters", type=int, default=40, help="timed verifies (and decode steps)")
    p.add_argument(
        "--rows",
        action="store_true",
        help="also time the verify laid out as decode rows, as GENSERVE_SPEC_COMPILED_VERIFY=1 "
        "runs it (under compile: the compiled decode step; its first call compiles)",
    )
    args = parse_engine_args(p)
    if args.smoke:
        args.iters, args.prompt_len = 3, 40

    from genserve import Engine
    from genserve.srt.forward_batch import ForwardMode
    from genserve.srt.speculative.verify_rows import build_verify_rows

    engine = Engine(
        args.model_path, quantization=args.quantization, compile=args.compile, dtype=args.dtype
    )
    runner = engine.scheduler.runner
    vocab = engine.runtime.config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=prompt[::-1], sampling_params=sp)  # warm-up (and the compile)

    n, plen = args.draft + 1, args.prompt_len
    (row,) = runner.req_to_token_pool.alloc(1)  # type: ignore[misc]
    slots = runner.allocator.alloc(plen + n)
    assert slots is not None
    runner.req_to_token_pool.write(row, 0, slots)
    prefill = runner.build_forward_batch(
        ForwardMode.EXTEND, [row], prompt, [0], [plen], slots[:plen]
    )
    runner.forward(prefill)
    draft = [rng.randrange(100, vocab) for _ in range(n)]

    def rows_batch():
        return build_verify_rows(runner, row, draft, plen, slots[plen:])

    def verify_batch():
        fb = runner.build_forward_batch(ForwardMode.EXTEND, [row], draft, [plen], [n], slots[plen:])
        fb.logits_indices = torch.arange(n, dtype=torch.int64)
        return fb

    def decode_batch():
        return runner.build_forward_batch(
            ForwardMode.DECODE, [row], draft[:1], [plen], [1], slots[plen : plen + 1]
        )

    sides = [("verify", verify_batch), ("decode", decode_batch)]
    if args.rows:
        sides.append(("verify_rows", rows_batch))
    times: dict[str, list[float]] = {k: [] for name, _ in sides for k in (name, name + "_build")}
    logits: dict[str, torch.Tensor] = {}
    for i in range(args.iters + 2):
        for name, build in sides:
            t0 = time.perf_counter()
            fb = build()
            t1 = time.perf_counter()
            out = runner.forward(fb)
            t2 = time.perf_counter()
            if name != "decode":
                logits[name] = out
            if i >= 2:  # the first two of each are warm-up
                times[name + "_build"].append((t1 - t0) * 1e3)
                times[name].append((t2 - t1) * 1e3)
    med = {k: round(statistics.median(v), 3) for k, v in times.items()}

    def argmax_sha1(name: str) -> str:
        return hashlib.sha1(str(logits[name].argmax(-1).tolist()).encode()).hexdigest()[:12]

    summary = {
        "threads": torch.get_num_threads(),
        "quantization": engine.server_info().get("quantization"),
        "compile": engine.server_info().get("compile"),
        "dtype": str(runner.dtype),
        "prompt_len": plen,
        "verify_tokens": n,
        "iters": len(times["verify"]),
        "verify_ms_median": med["verify"],
        "verify_build_ms_median": med["verify_build"],
        "decode_ms_median": med["decode"],
        "decode_build_ms_median": med["decode_build"],
        "verify_over_decode": round(med["verify"] / med["decode"], 2),
        "verify_argmax_sha1": argmax_sha1("verify"),
    }
    if args.rows:
        summary["verify_rows_ms_median"] = med["verify_rows"]
        summary["verify_rows_build_ms_median"] = med["verify_rows_build"]
        summary["verify_rows_over_decode"] = round(med["verify_rows"] / med["decode"], 2)
        summary["verify_rows_argmax_sha1"] = argmax_sha1("verify_rows")
    print(json.dumps(summary), flush=True)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                runner.forward(verify_batch())
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    runner.allocator.free(slots)
    runner.req_to_token_pool.free(row)
    engine.shutdown()


if __name__ == "__main__":
    main()
