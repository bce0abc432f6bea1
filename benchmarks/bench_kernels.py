"""Speed of the Triton attention kernels next to the device's peak and torch SDPA.

    python benchmarks/bench_kernels.py            # CUDA GPU: table
    python benchmarks/bench_kernels.py --json     # CUDA GPU: one JSON object on stdout
    python benchmarks/bench_kernels.py --smoke    # tiny sizes; on CPU under Triton's interpreter

- Decode attention (default: batch 64, 4096-token contexts, 32 query / 4 KV heads = GQA 8, head
  dim 128, bf16): achieved HBM bandwidth (K and V bytes read / time) vs the device's peak, and
  torch SDPA on the same KV, both pre-gathered (dense, the best case for torch) and including the
  gather from the pool (what a torch backend pays).
- Extend attention (default: a 4096-token prompt, no prefix, and 1024 new tokens after a
  3072-token cached prefix): TFLOP/s (causal FLOPs only) vs torch SDPA over the gathered KV.
Every kernel result is checked against SDPA before it is timed; a case whose max |error|
exceeds ERROR_LIMITS fails the run (exit status 1), after the table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

# Peak HBM bandwidth (GB/s) and dense bf16 tensor-core TFLOP/s, matched on the device name.
DEVICE_PEAKS = [
    ("H200", 4800.0, 989.0),
    ("H100 PCIe", 2000.0, 756.0),
    ("H100 NVL", 3900.0, 835.0),
    ("H100", 3350.0, 989.0),
    ("A100-SXM4-80GB", 2039.0, 312.0),
    ("A100 80GB PCIe", 1935.0, 312.0),
    ("A100", 1555.0, 312.0),
    ("L40S", 864.0, 362.0),
    ("A10G", 600.0, 70.0),
]


def device_peaks(name: str) -> tuple[float | None, float | None]:
    for key, bandwidth, tflops in DEVICE_PEAKS:
        if key.lower() in name.lower():
            return bandwidth, tflops
    return None, None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs without a GPU")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--batch", type=int, default=64, help="decode batch size")
    p.add_argument("--context", type=int, default=4096, help="decode context length")
    p.add_argument("--prompt", type=int, default=4096, help="extend prompt length")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.context, args.prompt = 2, 48, 40
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
    return args


def timed_ms(fn, on_gpu: bool) -> float:
    if on_gpu:
        return float(triton.testing.do_bench(fn, warmup=25, rep=200))
    fn()  # interpreter: one warm call, one timed call
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


# Max |triton - SDPA| allowed per dtype (unit-normal q/k/v; outputs are averages of values).
ERROR_LIMITS = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}


def failed_cases(result: dict) -> list[str]:
    """The cases whose output differs from SDPA by more than the dtype's limit."""
    limit = ERROR_LIMITS[result["dtype"]]
    cases = [("decode", result["decode"])] + [
        (f"extend prefix={e['shape']['prefix']}", e) for e in result["extend"]]
    return [f"{name}: max |err| vs SDPA {case['max_abs_error_vs_sdpa']:.2e} > {limit:.0e}"
            for name, case in cases if not case["max_abs_error_vs_sdpa"] <= limit]


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def bench_decode(args, device, dtype, on_gpu: bool) -> dict:
    from genserve.kernels.decode_attention import choose_num_kv_splits, decode_attention_fwd

    b, n, hq, hkv, d = args.batch, args.context, args.num_heads, args.num_kv_heads, args.head_dim
    slots = b * n
    k_buf = torch.randn(slots + 1, hkv, d, device=device, dtype=dtype)
    v_buf = torch.randn(slots + 1, hkv, d, device=device, dtype=dtype)
    kv_indices = torch.randperm(slots, device=device) + 1  # scattered pool slots
    kv_indptr = torch.arange(0, slots + 1, n, device=device)
    q = torch.randn(b, hq, d, device=device, dtype=dtype)
    o = torch.empty_like(q)
    scale = d**-0.5
    splits = choose_num_kv_splits(n, b, hkv, device)

    def triton_decode():
        decode_attention_fwd(q, k_buf, v_buf, o, kv_indptr, kv_indices, scale, splits)

    idx = kv_indices.view(b, n)

    def gather():  # [B, Hkv, n, D]
        return k_buf[idx].transpose(1, 2), v_buf[idx].transpose(1, 2)

    k_dense, v_dense = (t.contiguous() for t in gather())

    def sdpa(k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, scale=scale, enable_gqa=hq != hkv
        ).squeeze(2)

    triton_decode()
    error = max_error(o, sdpa(k_dense, v_dense))
    kv_bytes = 2 * b * n * hkv * d * k_buf.element_size()
    ms = {
        "triton": timed_ms(triton_decode, on_gpu),
        "sdpa_dense": timed_ms(lambda: sdpa(k_dense, v_dense), on_gpu),
        "sdpa_with_gather": timed_ms(lambda: sdpa(*gather()), on_gpu),
    }
    return {
        "shape": {
            "batch": b,
            "context": n,
            "num_heads": hq,
            "num_kv_heads": hkv,
            "head_dim": d,
            "num_kv_splits": splits,
        },
        "kv_bytes": kv_bytes,
        "max_abs_error_vs_sdpa": error,
        "ms": ms,
        "gb_per_s": {k: kv_bytes / (v * 1e-3) / 1e9 for k, v in ms.items()},
    }


def bench_extend(args, device, dtype, on_gpu: bool, prefix: int) -> dict:
    from genserve.kernels.extend_attention import extend_attention_fwd

    hq, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
    new = args.prompt - prefix
    k_buf = torch.randn(prefix + 1, hkv, d, device=device, dtype=dtype)
    v_buf = torch.randn(prefix + 1, hkv, d, device=device, dtype=dtype)
    kv_indices = torch.randperm(prefix, device=device) + 1
    kv_indptr = torch.tensor([0, prefix], device=device)
    qo_indptr = torch.tensor([0, new], device=device)
    q = torch.randn(new, hq, d, device=device, dtype=dtype)
    k = torch.randn(new, hkv, d, device=device, dtype=dtype)
    v = torch.randn(new, hkv, d, device=device, dtype=dtype)
    o = torch.empty_like(q)
    scale = d**-0.5

    def triton_extend():
        extend_attention_fwd(q, k, v, o, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, new, scale)

    # torch: gather the prefix, append the new K/V, SDPA with a bottom-right causal mask.
    cols = torch.arange(prefix + new, device=device)
    mask = cols[None, :] <= (torch.arange(new, device=device) + prefix)[:, None]

    def sdpa():
        keys = torch.cat([k_buf[kv_indices], k]).transpose(0, 1).unsqueeze(0)
        values = torch.cat([v_buf[kv_indices], v]).transpose(0, 1).unsqueeze(0)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys,
            values,
            attn_mask=mask if prefix else None,
            is_causal=prefix == 0,
            scale=scale,
            enable_gqa=hq != hkv,
        )
        return out.squeeze(0).transpose(0, 1)

    triton_extend()
    error = max_error(o, sdpa())
    # Causal FLOPs: QK^T and PV over the visible (query, key) pairs only.
    pairs = new * prefix + new * (new + 1) // 2
    flops = 4 * hq * d * pairs
    ms = {"triton": timed_ms(triton_extend, on_gpu), "sdpa_with_gather": timed_ms(sdpa, on_gpu)}
    return {
        "shape": {
            "prefix": prefix,
            "new_tokens": new,
            "num_heads": hq,
            "num_kv_heads": hkv,
            "head_dim": d,
        },
        "flops": flops,
        "max_abs_error_vs_sdpa": error,
        "ms": ms,
        "tflop_per_s": {k: flops / (v * 1e-3) / 1e12 for k, v in ms.items()},
    }


def print_table(result: dict) -> None:
    peak_bw, peak_tf = result["peak_gb_per_s"], result["peak_tflop_per_s"]
    print(
        f"device: {result['device']}  dtype: {result['dtype']}  "
        f"peak: {peak_bw or '?'} GB/s, {peak_tf or '?'} TFLOP/s"
    )
    dec = result["decode"]
    print(
        f"\ndecode attention {dec['shape']}  max |err| vs SDPA {dec['max_abs_error_vs_sdpa']:.2e}"
    )
    print(f"  {'impl':<18}{'ms':>10}{'GB/s':>10}{'% peak':>8}")
    for name, ms in dec["ms"].items():
        gbs = dec["gb_per_s"][name]
        pct = f"{100 * gbs / peak_bw:.0f}%" if peak_bw else "-"
        print(f"  {name:<18}{ms:>10.3f}{gbs:>10.0f}{pct:>8}")
    for ext in result["extend"]:
        print(
            f"\nextend attention {ext['shape']}  "
            f"max |err| vs SDPA {ext['max_abs_error_vs_sdpa']:.2e}"
        )
        print(f"  {'impl':<18}{'ms':>10}{'TFLOP/s':>10}{'% peak':>8}")
        for name, ms in ext["ms"].items():
            tf = ext["tflop_per_s"][name]
            pct = f"{100 * tf / peak_tf:.0f}%" if peak_tf else "-"
            print(f"  {name:<18}{ms:>10.3f}{tf:>10.1f}{pct:>8}")
        speedup = ext["ms"]["sdpa_with_gather"] / ext["ms"]["triton"]
        print(f"  triton vs SDPA: {speedup:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        if not args.smoke:
            print(
                "bench_kernels: no CUDA GPU found. The kernel benchmark needs a GPU; "
                "use --smoke for a tiny run under Triton's CPU interpreter.",
                file=sys.stderr,
            )
            return 2
        knobs = getattr(triton, "knobs", None)
        if knobs is None or not knobs.runtime.interpret:
            # The interpreter must be chosen before triton is imported: start over with it.
            env = {**os.environ, "TRITON_INTERPRET": "1"}
            os.execve(sys.executable, [sys.executable, *sys.argv], env)
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu (triton interpreter)"
    peak_bw, peak_tf = device_peaks(name) if on_gpu else (None, None)
    prefixes = [0, args.prompt * 3 // 4]
    result = {
        "device": name,
        "dtype": args.dtype,
        "smoke": args.smoke,
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "peak_gb_per_s": peak_bw,
        "peak_tflop_per_s": peak_tf,
        "decode": bench_decode(args, device, dtype, on_gpu),
        "extend": [bench_extend(args, device, dtype, on_gpu, p) for p in prefixes],
    }
    result["failed"] = failed_cases(result)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    for failure in result["failed"]:
        print(f"bench_kernels: FAILED {failure}", file=sys.stderr)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
