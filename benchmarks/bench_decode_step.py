"""Single-stream decode step of the default CPU server (issue 33's llama.cpp ratio).

An offline Engine set up as `genserve serve` sets it up on the embedded SmolLM2-135M-Instruct
GGUF (`--quantization auto`: int8wo, float32 elsewhere, the compiled batch-1 decode step)
decodes N greedy tokens after a P-token prompt. Each decode step's forward
(`ModelRunner.forward`) is timed, and so is the engine loop from one decode forward to the
next (sampling, the scheduler's bookkeeping, building the next batch).

    python benchmarks/bench_decode_step.py                 # median ms per step and tok/s
    python benchmarks/bench_decode_step.py --profile       # torch.profiler's top ops too
    python benchmarks/bench_decode_step.py --smoke         # float32, no quantization/compile

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


def timed_forwards(runner) -> tuple[list[float], list[float]]:
    """Wrap `runner.forward`: returns (decode forward seconds, decode forward start times)."""
    from genserve.srt.forward_batch import ForwardMode

    inner = runner.forward
    spans: list[float] = []
    starts: list[float] = []

    def forward(fb, *args, **kwargs):
        t = time.perf_counter()
        out = inner(fb, *args, **kwargs)
        if fb.mode is ForwardMode.DECODE:
            spans.append(time.perf_counter() - t)
            starts.append(t)
        return out

    runner.forward = forward
    return spans, starts


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine and prompt options this script shares with bench_verify_step.py."""
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top ops")
    p.add_argument("--top", type=int, default=30, help="ops listed by --profile")
    p.add_argument("--smoke", action="store_true", help="float32, no quantization or compile")


def parse_engine_args(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse; `--smoke` sets the engine to float32 without quantization or compile (each
    script then shrinks its own sizes)."""
    args = p.parse_args()
    if args.smoke:
        args.quantization, args.compile, args.dtype = "none", False, "float32"
    return args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    p.add_argument("--steps", type=int, default=64, help="decode steps per request")
    p.add_argument("--repeats", type=int, default=3, help="timed requests (after one warm-up)")
    p.add_argument(
        "--kernel-profile",
        action="store_true",
        help="with --profile: name each Inductor kernel of the compiled step (recompiles it)",
    )
    args = parse_engine_args(p)
    if args.smoke:
        args.steps, args.repeats, args.prompt_len = 8, 1, 40

    from genserve import Engine

    if args.kernel_profile:
        from torch._inductor import config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True

    t0 = time.perf_counter()
    engine = Engine(
        args.model_path, quantization=args.quantization, compile=args.compile, dtype=args.dtype
    )
    runner = engine.scheduler.runner
    start_s = time.perf_counter() - t0
    vocab = engine.runtime.config.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.repeats + 1)
    ]  # distinct: no radix-cache hit
    sp = {"max_new_tokens": args.steps + 1, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=prompts[0], sampling_params=sp)  # warm-up (and the compile)

    spans, starts = timed_forwards(runner)
    forward_ms: list[float] = []
    loop_ms: list[float] = []
    outputs = []
    for ids in prompts[1:]:
        spans.clear()
        starts.clear()
        outputs.append(engine.generate(input_ids=ids, sampling_params=sp)["output_ids"])
        # The same steps on both sides: each step's forward and the time to the next step's
        # start, which holds it (so no step's loop time is under its forward time).
        forward_ms += [s * 1e3 for s in spans[1:-1]]
        loop_ms += [(b - a) * 1e3 for a, b in zip(starts[1:], starts[2:])]
    fwd, loop = statistics.median(forward_ms), statistics.median(loop_ms)
    summary = {
        "threads": torch.get_num_threads(),
        "quantization": engine.server_info().get("quantization"),
        "compile": engine.server_info().get("compile"),
        "dtype": str(runner.dtype),
        "start_s": round(start_s, 1),
        "prompt_len": args.prompt_len,
        "decode_steps": len(forward_ms),
        "forward_ms_median": round(fwd, 2),
        "step_ms_median": round(loop, 2),  # forward + sampling + scheduler, per token
        "overhead_ms_median": round(loop - fwd, 2),
        "tok_s": round(1e3 / loop, 1),
        "outputs_sha1": hashlib.sha1(str(outputs).encode()).hexdigest()[:12],
    }
    print(json.dumps(summary), flush=True)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.generate(input_ids=prompts[1], sampling_params=sp)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    engine.shutdown()


if __name__ == "__main__":
    main()
