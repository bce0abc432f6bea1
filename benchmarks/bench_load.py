"""Peak host memory while loading a checkpoint, as a multiple of its size.

    python benchmarks/bench_load.py                 # ~0.52B-parameter Llama (~1 GB in bf16)
    python benchmarks/bench_load.py --smoke         # a few MB, to check the script runs
    python benchmarks/bench_load.py --json

Three checkpoints of the same random model (Llama layout) are written once by a child process:
- `bf16`: plain bfloat16 weights;
- `fp8`: the decoder's linear weights in float8_e4m3fn with 128x128 blocks of
  `weight_scale_inv` (the DeepSeek / Qwen3-FP8 layout), the rest bf16;
- `gptq`: the decoder's linear weights as 4-bit GPTQ (qweight / qzeros / scales / g_idx, group
  128), the rest bf16. Its integers are random: only sizes matter here;
- `awq`: the same as 4-bit AWQ GEMM (qweight / qzeros packed along the output, scales, group
  128); `ct-w4a16`: as compressed-tensors pack-quantized int4 (weight_packed / weight_scale /
  weight_shape, symmetric, group 128).
Each measured load runs in a fresh child: it imports torch, genserve and torchao, records its
resident set size (the baseline), loads, and reports its peak RSS (getrusage maxrss). Quantized
loads build the model in float32, the dtype a quantized model is served in on a CPU. (`--smoke`
forks its children from one process that imported those once: it checks the script's steps,
not its figures.) Loaders:
- `genserve` (bf16): the serving path (`model_runner.load_model`): meta-device init in bf16,
  tensors read from the file straight into the parameters;
- `naive` (bf16): the path genserve used before the model registry: the model built in fp32,
  the whole state dict loaded with `safetensors.torch.load_file`, copied in, cast to bf16;
- `genserve` (fp8, gptq): what `--quantization auto` does with them (`choose_quantization`
  from the checkpoint's precision class): fp8 as int8 weights, each linear layer dequantized
  and quantized as soon as it is loaded; the GPTQ, AWQ and compressed-tensors checkpoints as
  int4wo, their 4-bit groups repacked as stored (`layers/prequantized/int4_repack.py`);
- `genserve_int8wo` (gptq, awq, ct-w4a16): `--quantization int8wo` (each layer dequantized,
  then int8);
- `quantize_after` (fp8, gptq): the whole model dequantized into bf16 first, then quantized
  (genserve's path before layer-by-layer quantization).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

SIZES = {
    # ~0.52B parameters: 24 layers of hidden 1280, 32000-token vocabulary, untied head.
    "default": dict(
        hidden_size=1280,
        intermediate_size=3456,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
    ),
    "smoke": dict(
        hidden_size=128,  # GPTQ's 128-wide groups need widths of 128
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def write_checkpoint(folder: Path, size: dict) -> int:
    import torch
    from safetensors.torch import save_file

    cfg = dict(
        size,
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    (folder / "config.json").write_text(json.dumps(cfg))
    h, i, layers = size["hidden_size"], size["intermediate_size"], size["num_hidden_layers"]
    hd = h // size["num_attention_heads"]
    kv = size["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    weights = {
        "model.embed_tokens.weight": rand(size["vocab_size"], h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": rand(size["vocab_size"], h),
    }
    for n in range(layers):
        p = f"model.layers.{n}."
        weights.update(
            {
                p + "self_attn.q_proj.weight": rand(h, h),
                p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h),
                p + "self_attn.o_proj.weight": rand(h, h),
                p + "mlp.gate_proj.weight": rand(i, h),
                p + "mlp.up_proj.weight": rand(i, h),
                p + "mlp.down_proj.weight": rand(h, i),
                p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            }
        )
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() for t in weights.values())


def write_quantized(plain: Path, out: Path, fmt: str) -> None:
    """`out`: the plain checkpoint with its decoder linear weights stored in `fmt`."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(plain / "model.safetensors"))
    g = torch.Generator().manual_seed(1)

    def words(*shape: int) -> torch.Tensor:  # random 4-bit values, eight to an int32
        return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int32)

    stored: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if ".layers." not in name or not name.endswith("_proj.weight"):
            stored[name] = w
            continue
        module, (rows, cols) = name.removesuffix(".weight"), w.shape
        if fmt == "fp8":
            stored[name] = (w.float() * 100).to(torch.float8_e4m3fn)
            grid = (-(-rows // 128), -(-cols // 128))
            stored[module + ".weight_scale_inv"] = torch.full(grid, 0.01)
        elif fmt == "gptq":  # [in/8, out] words, [groups, out/8] zeros, [groups, out] scales
            groups = cols // 128
            stored[module + ".qweight"] = words(cols // 8, rows)
            stored[module + ".qzeros"] = torch.full((groups, rows // 8), 0x77777777,
                                                    dtype=torch.int32)
            stored[module + ".scales"] = torch.full((groups, rows), 0.002, dtype=torch.float16)
            stored[module + ".g_idx"] = (torch.arange(cols) // 128).to(torch.int32)
        elif fmt == "awq":  # [in, out/8] words, [groups, out/8] zeros, [groups, out] scales
            groups = cols // 128
            stored[module + ".qweight"] = words(cols, rows // 8)
            stored[module + ".qzeros"] = torch.full((groups, rows // 8), 0x77777777,
                                                    dtype=torch.int32)
            stored[module + ".scales"] = torch.full((groups, rows), 0.002, dtype=torch.float16)
        else:  # ct-w4a16: [out, in/8] words, [out, groups] scales, the [out, in] shape
            stored[module + ".weight_packed"] = words(rows, cols // 8)
            stored[module + ".weight_scale"] = torch.full((rows, cols // 128), 0.002,
                                                          dtype=torch.bfloat16)
            stored[module + ".weight_shape"] = torch.tensor([rows, cols])
    del weights
    cfg = json.loads((plain / "config.json").read_text())
    out.mkdir()
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": QCONFIGS[fmt]}))
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})


QCONFIGS = {
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
             "sym": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
            "version": "gemm"},
    "ct-w4a16": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                 "ignore": ["lm_head"], "config_groups": {"group_0": {
                     "targets": ["Linear"], "format": "pack-quantized",
                     "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                 "strategy": "group", "group_size": 128}}}},
}
QUANTIZED = tuple(QCONFIGS)


def measure(folder: Path, loader: str) -> dict:
    import torch
    import torchao  # noqa: F401 (imported by any quantized load: part of the baseline)

    from genserve.srt.layers.prequantized import precision_class
    from genserve.srt.layers.quantization import choose_quantization, quantize_model
    from genserve.srt.model_config import ModelConfig
    from genserve.srt.model_runner import load_model
    from genserve.srt.models.base import ModelKernels

    cfg = ModelConfig.from_folder(folder)
    quantized = "quantization_config" in cfg.hf
    baseline = _rss_bytes()
    # A quantized model is served in float32 on a CPU (`engine_core._quantized_cpu_dtype`):
    # the quantized loads run in that dtype, as `genserve serve` runs them.
    dtype = torch.float32 if quantized else torch.bfloat16
    chosen: list[str] = []  # the weight-only mode of a `genserve` load
    if loader in ("genserve", "genserve_int8wo"):
        cpu, source = torch.device("cpu"), precision_class(folder)
        requested = "int8wo" if loader == "genserve_int8wo" else "auto"

        def mode(model) -> str:
            chosen.append(choose_quantization(requested, source, model, cpu).mode)
            return chosen[-1]

        wo = mode if quantized else None
        load_model(cfg, folder, cpu, dtype, ModelKernels(), quantization=wo)
    elif loader == "quantize_after":
        model = load_model(cfg, folder, torch.device("cpu"), dtype, ModelKernels())
        quantize_model(model, "int8wo")
    else:
        from genserve.srt.model_loader import load_state_dict
        from genserve.srt.models.registry import get_model_class

        model = get_model_class(cfg.architecture)(cfg, ModelKernels())  # fp32, initialised
        model.load_weights(load_state_dict(folder).items())
        model.to(torch.bfloat16)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"baseline_rss": baseline, "peak_rss": peak, "mode": chosen[0] if chosen else None}


def write_all(plain: Path, size: dict, formats: list[str]) -> int:
    """The plain checkpoint in `plain`, then the quantized ones of `formats` beside it; its
    parameter count."""
    parameters = write_checkpoint(plain, size)
    for fmt in [f for f in QUANTIZED if f in formats]:
        write_quantized(plain, plain.parent / fmt, fmt)
    return parameters


def child_context(smoke: bool) -> Any:
    """Where each step runs: a fresh interpreter per step (spawn), so every measured load
    starts from a process that has only imported; under --smoke, a fork of one process that
    imported torch, torchao and genserve once (its RSS figures are not comparable: a fork
    maps the libraries' pages without counting them until they are touched again)."""
    if not smoke:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torchao", "safetensors", "genserve.srt.model_runner",
                                "genserve.srt.layers.quantization", "genserve.srt.model_loader"])
    return ctx


def in_child(ctx: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a new process of `ctx` (one process per call)."""
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--formats", nargs="+", choices=("bf16", *QUANTIZED),
                    default=["bf16", "fp8", "gptq"], help="checkpoints to measure")
    args = ap.parse_args()
    size = SIZES["smoke" if args.smoke else "default"]
    ctx = child_context(args.smoke)
    runs = {"bf16": ("genserve", "naive"), "fp8": ("genserve", "quantize_after"),
            "gptq": ("genserve", "genserve_int8wo", "quantize_after"),
            "awq": ("genserve", "genserve_int8wo"), "ct-w4a16": ("genserve", "genserve_int8wo")}
    runs = {fmt: loaders for fmt, loaders in runs.items() if fmt in args.formats}
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "bf16"
        plain.mkdir()
        # One writer process for every checkpoint (each process start imports torch again).
        results["parameters"] = in_child(ctx, write_all, plain, size, args.formats)
        for fmt, loaders in runs.items():
            folder = Path(tmp) / fmt
            ckpt = (folder / "model.safetensors").stat().st_size
            results[fmt] = {"checkpoint_bytes": ckpt}
            for loader in loaders:
                r = in_child(ctx, measure, folder, loader)
                r["peak_over_checkpoint"] = round(r["peak_rss"] / ckpt, 3)
                r["load_delta_over_checkpoint"] = round(
                    (r["peak_rss"] - r["baseline_rss"]) / ckpt, 3)
                results[fmt][loader] = r
    # The bf16 figures also at the top level, as before the quantized checkpoints were added.
    if "bf16" in results:
        results.update({k: results["bf16"][k] for k in ("checkpoint_bytes", "genserve", "naive")})
    if args.json:
        print(json.dumps(results))
        return
    print(f"model: {results['parameters'] / 1e9:.3f}B parameters")
    for fmt, loaders in runs.items():
        ckpt = results[fmt]["checkpoint_bytes"]
        for loader in loaders:
            r = results[fmt][loader]
            print(
                f"{fmt:8s} {ckpt / 2**20:5.0f} MiB {loader:15s} {r['mode'] or '':6s} baseline "
                f"{r['baseline_rss'] / 2**20:6.0f} MiB  peak {r['peak_rss'] / 2**20:6.0f} MiB  "
                f"peak/ckpt {r['peak_over_checkpoint']:.2f}  "
                f"(peak - baseline)/ckpt {r['load_delta_over_checkpoint']:.2f}"
            )


if __name__ == "__main__":
    main()
