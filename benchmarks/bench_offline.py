"""Offline LLM engine benchmark (issue: LLM runtime core). Ratios are measured side by side in
one run, on the same machine, with the same model (SmolLM2-135M-Instruct, bf16 by default).

    python benchmarks/bench_offline.py                 # everything, JSON summary at the end
    python benchmarks/bench_offline.py --skip-hf       # without the slow HF baseline
    python benchmarks/bench_offline.py --smoke         # a tiny random model: checks the script

Workloads:
 1. shared prefix: G groups x P requests, S-token system prompt per group, Q-token question,
    O output tokens (ignore_eos); genserve Engine vs HF transformers `generate` one by one.
 2. no sharing: N random L-token prompts, O output tokens; radix cache on vs off.
 3. decode: tokens/s at batch 32 vs batch 1.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time

import torch


def rand_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Skip the first ids: SmolLM2 keeps its special tokens there.
    return [rng.randrange(100, vocab) for _ in range(n)]


def shared_prefix_workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    reqs = []
    for _ in range(args.groups):
        system = rand_ids(rng, args.system_len, vocab)
        for _ in range(args.per_group):
            reqs.append(system + rand_ids(rng, args.question_len, vocab))
    rng.shuffle(reqs)  # arrival order mixes the groups, as real traffic does
    return reqs


def run_engine(engine, reqs, out_len) -> tuple[float, list[dict]]:
    sp = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
    t = time.perf_counter()
    outs = engine.generate(input_ids=reqs, sampling_params=sp)
    return time.perf_counter() - t, outs


def run_hf(model, reqs, out_len) -> float:
    t = time.perf_counter()
    with torch.inference_mode():
        for ids in reqs:
            inp = torch.tensor([ids])
            model.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                max_new_tokens=out_len,
                min_new_tokens=out_len,
                do_sample=False,
                pad_token_id=0,
            )
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument(
        "--dtype",
        default="bfloat16",
        help="genserve dtype (auto picks float32 on CPUs without native bf16)",
    )
    p.add_argument("--hf-dtype", default=None, help="HF baseline dtype (default: --dtype)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--random-num", type=int, default=64)
    p.add_argument("--random-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument(
        "--hf-sample",
        type=int,
        default=0,
        help="run HF on this many of the requests (evenly spread) and scale its time to all of "
        "them; 0 = all (HF runs them one by one, so its time is linear in the count)",
    )
    p.add_argument("--only", choices=["shared", "random", "decode"], default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--decode-len", type=int, default=64, help="output tokens of workload 3")
    p.add_argument("--smoke", action="store_true",
                   help="every workload at a toy size on a tiny random model, float32")
    args = p.parse_args()
    if args.smoke:
        from genserve.bench.tiny import tiny_chat_model

        args.model_path = args.model_path or str(tiny_chat_model())
        args.dtype = "float32"
        args.groups = args.per_group = args.output_len = args.random_num = 2
        args.system_len, args.question_len, args.random_len = 16, 4, 8
        args.random_output_len, args.decode_len = 2, 4

    from genserve import Engine

    results: dict = {}
    engine = Engine(args.model_path, dtype=args.dtype, max_total_tokens=65536)
    results["dtype"] = str(engine.runtime.runner.dtype)
    results["hf_dtype"] = args.hf_dtype or args.dtype
    vocab = engine.runtime.config.vocab_size
    # Warm-up: first calls pay one-time allocation costs.
    run_engine(engine, [rand_ids(random.Random(9), 64, vocab)] * 2, 4)
    engine.flush_cache()

    if args.only in (None, "shared"):
        reqs = shared_prefix_workload(args, vocab)
        total_tokens = sum(len(r) for r in reqs) + len(reqs) * args.output_len
        dt, outs = run_engine(engine, reqs, args.output_len)
        stats = engine.server_info()["stats"]
        hit = stats["cached_tokens"] / max(1, stats["prompt_tokens"])
        max_hit = (len(reqs) - args.groups) * args.system_len / sum(len(r) for r in reqs)
        res = {
            "requests": len(reqs),
            "genserve_s": dt,
            "genserve_tok_per_s": total_tokens / dt,
            "cache_hit_rate": hit,
            "cache_hit_rate_max": max_hit,
        }
        engine.check_integrity()
        engine.flush_cache()
        if not args.skip_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(
                engine.runtime.folder, dtype=getattr(torch, args.hf_dtype or args.dtype)
            ).eval()
            run_hf(hf, reqs[:1], 2)
            sample = reqs
            if 0 < args.hf_sample < len(reqs):
                step = len(reqs) / args.hf_sample
                sample = [reqs[int(i * step)] for i in range(args.hf_sample)]
            hf_dt = run_hf(hf, sample, args.output_len) * len(reqs) / len(sample)
            res.update(
                hf_requests_run=len(sample),
                hf_s=hf_dt,
                hf_tok_per_s=total_tokens / hf_dt,
                speedup=hf_dt / dt,
            )
            del hf
        results["shared_prefix"] = res
        print("shared prefix:", json.dumps(res, indent=1))

    if args.only in (None, "random"):
        rng = random.Random(1)
        reqs = [rand_ids(rng, args.random_len, vocab) for _ in range(args.random_num)]
        off = Engine(
            args.model_path, dtype=args.dtype, max_total_tokens=65536, disable_radix_cache=True
        )
        run_engine(off, reqs[:2], 4)
        # Alternate on/off twice and keep the best of each, to damp machine noise.
        on_t, off_t = [], []
        for _ in range(2):
            engine.flush_cache()
            on_t.append(run_engine(engine, reqs, args.random_output_len)[0])
            off_t.append(run_engine(off, reqs, args.random_output_len)[0])
        res = {
            "radix_on_s": min(on_t),
            "radix_off_s": min(off_t),
            "on_vs_off_throughput": min(off_t) / min(on_t),
        }
        del off
        results["no_sharing"] = res
        print("no sharing:", json.dumps(res, indent=1))

    if args.only in (None, "decode"):
        rng = random.Random(2)
        out_len = args.decode_len
        res = {}
        for bs in (1, 32):
            reqs = [rand_ids(rng, 16, vocab) for _ in range(bs)]
            engine.flush_cache()
            dt, _ = run_engine(engine, reqs, out_len)
            # Subtract the prefill to isolate decode: time a 1-token run of the same batch.
            engine.flush_cache()
            pre, _ = run_engine(engine, reqs, 1)
            res[f"batch{bs}_decode_tok_per_s"] = bs * (out_len - 1) / max(dt - pre, 1e-9)
        res["ratio_32_vs_1"] = res["batch32_decode_tok_per_s"] / res["batch1_decode_tok_per_s"]
        results["decode"] = res
        print("decode:", json.dumps(res, indent=1))

    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results["threads"] = torch.get_num_threads()
    print(json.dumps(results, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
