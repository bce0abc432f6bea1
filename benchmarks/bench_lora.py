"""Multi-LoRA throughput: 16 requests over 4 adapters in one batch against 16 base-model
requests, side by side on one engine.

    python benchmarks/bench_lora.py                 # the embedded SmolLM2-135M-Instruct
    python benchmarks/bench_lora.py --smoke         # a tiny random Llama, seconds

Four random PEFT adapters (rank --rank on q/k/v/o/gate/up/down, written as PEFT folders) are
served with `lora_paths`; each round runs the 16 base requests, then the 16 adapted ones
(request i under adapter i % 4), greedy with ignore_eos, the prefix cache flushed before each
run so both prefill the same prompts. Reports output tokens/s per side (prefill included), the
ratio (goal >= 0.7x) and prints a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, cfg: dict, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder for a Llama-shaped model with config `cfg` (random A and B)."""
    import torch
    from safetensors.torch import save_file

    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    q = cfg["num_attention_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for t in TARGETS:
            part = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{t}"
            n_in, n_out = shapes[t]
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none"}))
    return folder


def tiny_model(folder: Path) -> Path:
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def run(engine, prompts: list[list[int]], max_new: int, loras: list[str | None]) -> float:
    """Output tokens per second of one batch."""
    engine.flush_cache()
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    out = engine.generate(input_ids=prompts, sampling_params=params, lora_path=loras)
    seconds = time.perf_counter() - start
    return sum(len(o["output_ids"]) for o in out) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny random model, a few seconds")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2")
    args = ap.parse_args()
    from genserve import Engine
    from genserve.srt.model_loader import resolve_model_folder

    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    if args.smoke:
        model_path: str | None = str(tiny_model(tmp / "model"))
        prompt_len, max_new = args.prompt_tokens or 32, args.max_tokens or 16
    else:
        model_path = args.model_path
        prompt_len, max_new = args.prompt_tokens or 128, args.max_tokens or 64
    folder = resolve_model_folder(model_path)[0]
    cfg = json.loads((folder / "config.json").read_text())
    names = [f"adapter{i}" for i in range(args.adapters)]
    paths = [f"{n}={write_adapter(tmp / n, cfg, args.rank, i)}" for i, n in enumerate(names)]
    engine = Engine(model_path, lora_paths=paths, max_total_tokens=16384)
    rng = random.Random(0)
    vocab = min(cfg["vocab_size"], 30000)
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)]
               for _ in range(args.requests)]
    adapted = [names[i % len(names)] for i in range(args.requests)]
    run(engine, prompts[:2], 4, [None, names[0]])  # warm-up
    base, lora = [], []
    for _ in range(args.rounds):
        base.append(run(engine, prompts, max_new, [None] * args.requests))
        lora.append(run(engine, prompts, max_new, adapted))
    engine.check_integrity()
    info = engine.model_info()
    summary = {
        "model": info["model_name"], "dtype": info["dtype"], "device": info["device"],
        "quantization": info["quantization"], "requests": args.requests,
        "adapters": args.adapters, "rank": args.rank, "prompt_tokens": prompt_len,
        "max_new_tokens": max_new, "base_tok_s": round(max(base), 1),
        "lora_tok_s": round(max(lora), 1), "ratio": round(max(lora) / max(base), 3),
    }
    print(f"{'':<28}{'tok/s':>10}")
    print(f"{'base model x' + str(args.requests):<28}{summary['base_tok_s']:>10}")
    print(f"{f'{args.adapters} adapters x {args.requests}':<28}{summary['lora_tok_s']:>10}")
    print(f"ratio {summary['ratio']}x (goal >= 0.7x)")
    print(json.dumps(summary))
    engine.shutdown()


if __name__ == "__main__":
    main()
