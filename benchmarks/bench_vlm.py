"""Vision-language serving benchmark (issue 14). Ratios are measured side by side in one run
on the same machine and the same random weights.

    python benchmarks/bench_vlm.py            # prints a JSON summary at the end
    python benchmarks/bench_vlm.py --smoke    # the smallest Qwen2-VL, 2 requests: checks it

Workload: 16 requests, each the same 448x448 image and a different question, on a small
random-weight Qwen2-VL with real layer widths (vision tower: 1280 wide, 16 heads, 14 px
patches, 2x2 merge, so the image is 256 tokens; decoder: 1536 wide, 12 heads, 2 KV heads,
8960 MLP) and few layers. Three runs of the same requests:
 1. genserve Engine, radix cache on (the image's tokens are prefilled once);
 2. genserve Engine with --disable-radix-cache (each request prefills the image's tokens;
    the image-embedding cache still encodes the image once);
 3. Hugging Face transformers `generate`, one request after another.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.srt.vlm_models import hf_reference, make_tiny_qwen2_vl, png_bytes  # noqa: E402

QUESTIONS = [
    "what is in the image ?", "describe this picture .", "what color is the square ?",
    "how many circle ?", "what shape is left ?", "what shape is right ?",
    "is the circle red ?", "is the square blue ?", "compare the left and right .",
    "what is the color of the circle ?", "describe the shape .", "how many red ?",
    "what is green ?", "is this a picture ?", "what color is left ?", "what is right ?",
]


def build(folder: Path, vision_layers: int, text_layers: int, smoke: bool = False) -> Path:
    if smoke:  # the test suite's tiny Qwen2-VL: 64 wide, 2 + 2 layers
        return make_tiny_qwen2_vl(folder)
    return make_tiny_qwen2_vl(
        folder,
        vision={"depth": vision_layers, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4,
                "hidden_size": 1536},
        text_overrides={"hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
                        "num_key_value_heads": 2, "num_hidden_layers": text_layers,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                            "mrope_section": [16, 24, 24]}},
        max_pixels=28 * 28 * 1280,
    )


def prompts(engine, questions: list[str]) -> list[list[int]]:
    out = []
    for q in questions:
        content = [{"type": "image"}, {"type": "text", "text": q}]
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        out.append(engine.tokenizer.encode(text))
    return out


def run_engine(folder: Path, reqs: list[list[int]], image: bytes, out_len: int,
               disable_radix: bool) -> tuple[float, list[list[int]], dict]:
    from genserve import Engine

    engine = Engine(str(folder), dtype="float32", max_total_tokens=16384,
                    disable_radix_cache=disable_radix)
    sp = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
    t = time.perf_counter()
    outs = engine.generate(input_ids=reqs, image_data=[image] * len(reqs), sampling_params=sp)
    seconds = time.perf_counter() - t
    engine.check_integrity()
    info = engine.server_info()
    return seconds, [o["output_ids"] for o in outs], info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vision-layers", type=int, default=2)
    parser.add_argument("--text-layers", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=448, help="a multiple of 28")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest Qwen2-VL, a 56x56 image, 2 requests of 2 tokens")
    args = parser.parse_args()
    questions = QUESTIONS
    if args.smoke:
        args.image_size, args.output_len, questions = 56, 2, QUESTIONS[:2]
        args.vision_layers = args.text_layers = 2  # what make_tiny_qwen2_vl builds
    size = args.image_size
    image_tokens = (size // 28) ** 2
    image = png_bytes(size, size, 0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp) / "qwen2-vl-bench", args.vision_layers, args.text_layers,
                       args.smoke)
        from transformers import AutoTokenizer

        class _Tok:  # what prompts() reads from an engine
            tokenizer = AutoTokenizer.from_pretrained(folder)

        reqs = prompts(_Tok, questions)
        n = len(reqs)
        radix_s, radix_out, radix_info = run_engine(folder, reqs, image, args.output_len, False)
        plain_s, plain_out, plain_info = run_engine(folder, reqs, image, args.output_len, True)
        import transformers as tf

        model = tf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        t = time.perf_counter()
        hf_out = [hf_reference(folder, ids, [image], args.output_len, model=model)
                  for ids in reqs]
        hf_s = time.perf_counter() - t
    summary = {
        "requests": n,
        "image": f"{size}x{size} ({image_tokens} image tokens)",
        "prompt_tokens_first": len(reqs[0]) + image_tokens - 1,
        "output_tokens_each": args.output_len,
        "vision_layers": args.vision_layers,
        "text_layers": args.text_layers,
        "genserve_radix_s": round(radix_s, 2),
        "genserve_no_radix_s": round(plain_s, 2),
        "hf_one_by_one_s": round(hf_s, 2),
        "radix_vs_no_radix": round(plain_s / radix_s, 2),
        "radix_vs_hf": round(hf_s / radix_s, 2),
        "radix_cached_tokens": radix_info["stats"]["cached_tokens"],
        "images_encoded_radix": radix_info["multimodal"]["images_encoded"],
        "images_encoded_no_radix": plain_info["multimodal"]["images_encoded"],
        "tokens_equal_radix_no_radix": radix_out == plain_out,
        "tokens_equal_hf": radix_out == hf_out,
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
