"""The fp8 step of benchmarks/device_check.py: an FP8 checkpoint's layers kept in float8
(`--quantization fp8`: `torch._scaled_mm`, activations quantized per token) against the same
weights dequantized once into bf16 (`F.linear`), on a Qwen2.5-0.5B-shaped decoder layer's linear
set (q/k/v fused, o, gate/up fused, down), at decode and prefill token counts. A dry run takes
toy widths on the CPU through the same code."""

from __future__ import annotations

from device_check_llm import Context, row

# (out, in) of one decoder layer's linears: Qwen2.5-0.5B (hidden 896, 14 heads / 2 KV heads of
# 64, intermediate 4864).
LAYERS_05B = ((1152, 896), (896, 896), (9728, 896), (896, 4864))
LAYERS_TOY = ((48, 32), (32, 32), (128, 32), (32, 64))
TOKENS = (1, 16, 256, 2048)
TOKENS_TOY = (1, 5)


def _timed(ctx: Context, fn, repeats: int) -> float:
    """Seconds per call (after two warm-up calls)."""
    fn()
    fn()
    return ctx.seconds(lambda: [fn() for _ in range(repeats)]) / repeats


def step_fp8(ctx: Context) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from genserve.srt.layers.fp8_linear import FP8, FP8_MAX, fp8_linear, pad_to_16

    ctx.require_device()
    dev = ctx.device
    layers, tokens = (LAYERS_TOY, TOKENS_TOY) if ctx.dry_run else (LAYERS_05B, TOKENS)
    repeats = 2 if ctx.dry_run else 50
    gen = torch.Generator(device="cpu").manual_seed(0)
    kept, dense = [], []
    for out, inn in layers:
        w = torch.randn(out, inn, generator=gen) * 0.02
        scale = w.abs().amax(dim=1) / FP8_MAX
        q = (w / scale[:, None]).to(FP8)
        kept.append((*pad_to_16(q.to(dev), scale.to(dev)), out))
        dense.append((q.float() * scale[:, None]).to(dev, torch.bfloat16))  # dequantized once
    rows = []
    for m in tokens:
        xs = [torch.randn(m, inn, generator=gen).to(dev, torch.bfloat16) for _, inn in layers]

        def run_fp8(xs=xs):
            return [fp8_linear(x, w, s, o) for x, (w, s, o) in zip(xs, kept, strict=True)]

        def run_bf16(xs=xs):
            return [F.linear(x, w) for x, w in zip(xs, dense, strict=True)]

        rel = max(
            ((a.float() - b.float()).norm() / b.float().norm()).item()
            for a, b in zip(run_fp8(), run_bf16(), strict=True)
        )
        t8, t16 = _timed(ctx, run_fp8, repeats), _timed(ctx, run_bf16, repeats)
        rows.append(
            row(
                f"one decoder layer's linears, {m} tokens: fp8 _scaled_mm vs bf16 dequantized",
                f"{t8 * 1e6:.0f} us vs {t16 * 1e6:.0f} us ({t16 / t8:.2f}x)",
                f"rel. error vs bf16 {rel:.3f}; weights {'toy' if ctx.dry_run else '0.5B-shaped'}",
            )
        )
    return rows
