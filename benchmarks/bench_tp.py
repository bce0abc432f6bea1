"""Tensor parallelism: `--tp 2` next to `--tp 1` on the same workload, measured side by side.

The offline Engine with SmolLM2-135M (float32) generates O tokens (ignore_eos) for B random
prompts of L tokens; rounds alternate tp sizes. The cores this process may use are split evenly
between the ranks (torch threads = cores // tp), so both sizes use the same cores. Prints
end-to-end output tok/s per size and the ratio, and a JSON summary.

Usage: python benchmarks/bench_tp.py [--batch 16] [--prompt-len 128] [--output-len 32]
       python benchmarks/bench_tp.py --smoke    # a tiny random model: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from genserve import Engine


def run(tp: int, prompts: list[list[int]], out_len: int, threads: int,
        model_path: str | None = None) -> float:
    """Output tokens per second of one generate call over every prompt (engine start-up and
    a warm-up request excluded)."""
    sp = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
    with Engine(
        model_path,
        tp_size=tp,
        dtype="float32",
        max_total_tokens=8192,
        num_threads=threads,
        disable_radix_cache=True,  # every round computes every prompt
    ) as engine:
        engine.generate(input_ids=prompts[:1], sampling_params={**sp, "max_new_tokens": 2})
        t = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=sp)
        return len(prompts) * out_len / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny random model, 2 prompts of 8 tokens, 2 new tokens, 1 round")
    args = p.parse_args()
    if args.smoke:
        from genserve.bench.tiny import tiny_chat_model

        args.model_path = args.model_path or str(tiny_chat_model())
        args.batch, args.prompt_len, args.output_len, args.rounds = 2, 8, 2, 1
    cores = len(os.sched_getaffinity(0))
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 49152) for _ in range(args.prompt_len)] for _ in range(args.batch)
    ]
    results: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.rounds):
        for tp in (1, 2):
            tok_s = run(tp, prompts, args.output_len, max(1, cores // tp), args.model_path)
            results[tp].append(tok_s)
            print(f"tp={tp}: {tok_s:.1f} output tok/s", flush=True)
    summary = {
        "cores": cores,
        **vars(args),
        "tp1_tok_s": statistics.median(results[1]),
        "tp2_tok_s": statistics.median(results[2]),
    }
    summary["tp2_over_tp1"] = summary["tp2_tok_s"] / summary["tp1_tok_s"]
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
