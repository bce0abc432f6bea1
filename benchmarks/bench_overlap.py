"""Decode tok/s with `--enable-overlap-schedule` on vs off, side by side.

    python benchmarks/bench_overlap.py                       # SmolLM2-135M, batch 1 and 8
    python benchmarks/bench_overlap.py --batches 1,16 --rounds 5 --out-len 128

Two engines on one model (default: the embedded SmolLM2-135M-Instruct, `--quantization none`,
no compile: the overlap schedule refuses --compile), one plain and one with the overlap
schedule. Each round runs every batch size on both, alternating which goes first. A run is
`batch` random prompts of 32 tokens decoding `--out-len` tokens greedily with ignore_eos; its
decode rate is (batch x (out_len - 1)) / (run time - the same prompts' prefill-only time), with
the prefix cache flushed before each. Prints each round and the medians, checks that both
engines give identical tokens, and prints a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def timed(engine, prompts: list[list[int]], out_len: int) -> tuple[float, list[list[int]]]:
    engine.flush_cache()
    sp = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=sp)
    return time.perf_counter() - start, [o["output_ids"] for o in outs]


def decode_rate(engine, prompts: list[list[int]], out_len: int) -> tuple[float, list]:
    full, tokens = timed(engine, prompts, out_len)
    prefill, _ = timed(engine, prompts, 1)
    return len(prompts) * (out_len - 1) / max(full - prefill, 1e-9), tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    from genserve import Engine

    common = dict(
        dtype=args.dtype,
        quantization="none",
        compile=False,
        num_threads=args.threads,
        max_total_tokens=16384,
    )
    engines = {
        "off": Engine(args.model_path, **common),
        "on": Engine(args.model_path, **common, enable_overlap_schedule=True),
    }
    vocab = engines["off"].runtime.config.vocab_size
    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(0)
    prompts = {
        b: [[rng.randrange(100, vocab) for _ in range(32)] for _ in range(b)] for b in batches
    }
    for b in batches:  # warm-up: first calls allocate
        for engine in engines.values():
            timed(engine, prompts[b], 4)
    rates: dict[str, dict[int, list[float]]] = {k: {b: [] for b in batches} for k in engines}
    identical = True
    for r in range(args.rounds):
        order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
        for b in batches:
            tokens = {}
            for name in order:
                rate, tokens[name] = decode_rate(engines[name], prompts[b], args.out_len)
                rates[name][b].append(rate)
            identical &= tokens["on"] == tokens["off"]
            print(
                f"round {r + 1} batch {b}: off {rates['off'][b][-1]:.1f} tok/s, "
                f"on {rates['on'][b][-1]:.1f} tok/s",
                flush=True,
            )
    summary = {
        "dtype": str(engines["off"].runtime.runner.dtype),
        "out_len": args.out_len,
        "identical_tokens": identical,
        "batches": {},
    }
    for b in batches:
        off, on = statistics.median(rates["off"][b]), statistics.median(rates["on"][b])
        summary["batches"][b] = {
            "off": round(off, 1),
            "on": round(on, 1),
            "ratio": round(on / off, 3),
        }
        print(f"batch {b}: median off {off:.1f} tok/s, on {on:.1f} tok/s ({on / off:.2f}x)")
    print(json.dumps(summary))
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
