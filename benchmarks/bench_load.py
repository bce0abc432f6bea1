"""Peak host memory while loading a bf16 safetensors checkpoint, as a multiple of its size.

    python benchmarks/bench_load.py                 # ~0.52B-parameter Llama, bf16 (~1 GB)
    python benchmarks/bench_load.py --smoke         # a few MB, to check the script runs
    python benchmarks/bench_load.py --json

The checkpoint (random bf16 weights, Llama layout) is written once by a child process. Each
measured load runs in a fresh child: it imports torch and genserve, records its resident set
size (the baseline), loads, and reports its peak RSS (getrusage maxrss). Two loaders are
measured side by side:
- `genserve`: the serving path (`model_runner.load_model`): meta-device init in bf16, tensors
  read from the file straight into the parameters;
- `naive`: the path genserve used before the model registry: the model built in fp32, the
  whole state dict loaded with `safetensors.torch.load_file`, copied in, then cast to bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

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
        hidden_size=64,
        intermediate_size=128,
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


def measure(folder: Path, loader: str) -> dict:
    import torch

    from genserve.srt.model_config import ModelConfig
    from genserve.srt.model_runner import load_model
    from genserve.srt.models.base import ModelKernels

    cfg = ModelConfig.from_folder(folder)
    baseline = _rss_bytes()
    if loader == "genserve":
        load_model(cfg, folder, torch.device("cpu"), torch.bfloat16, ModelKernels())
    else:
        from genserve.srt.model_loader import load_state_dict
        from genserve.srt.models.registry import get_model_class

        model = get_model_class(cfg.architecture)(cfg, ModelKernels())  # fp32, initialised
        model.load_weights(load_state_dict(folder).items())
        model.to(torch.bfloat16)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"baseline_rss": baseline, "peak_rss": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--measure", nargs=2, metavar=("FOLDER", "LOADER"), help=argparse.SUPPRESS)
    ap.add_argument("--write", metavar="FOLDER", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure[0]), args.measure[1])))
        return
    size = SIZES["smoke" if args.smoke else "default"]
    if args.write:
        print(write_checkpoint(Path(args.write), size))
        return
    here = [sys.executable, os.path.abspath(__file__)] + (["--smoke"] if args.smoke else [])
    with tempfile.TemporaryDirectory() as tmp:
        params = int(subprocess.check_output(here + ["--write", tmp]))
        ckpt = (Path(tmp) / "model.safetensors").stat().st_size
        results = {"parameters": params, "checkpoint_bytes": ckpt}
        for loader in ("genserve", "naive"):
            out = subprocess.check_output(here + ["--measure", tmp, loader])
            r = json.loads(out)
            r["peak_over_checkpoint"] = round(r["peak_rss"] / ckpt, 3)
            r["load_delta_over_checkpoint"] = round((r["peak_rss"] - r["baseline_rss"]) / ckpt, 3)
            results[loader] = r
    if args.json:
        print(json.dumps(results))
        return
    print(f"checkpoint: {params / 1e9:.3f}B parameters, {ckpt / 2**20:.0f} MiB (bf16)")
    for loader in ("genserve", "naive"):
        r = results[loader]
        print(
            f"{loader:9s} baseline {r['baseline_rss'] / 2**20:6.0f} MiB  peak "
            f"{r['peak_rss'] / 2**20:6.0f} MiB  peak/ckpt {r['peak_over_checkpoint']:.2f}  "
            f"(peak - baseline)/ckpt {r['load_delta_over_checkpoint']:.2f}"
        )


if __name__ == "__main__":
    main()
