"""Tiny random-weight vision-language checkpoints (HF format: config, safetensors, word-level
tokenizer with a chat template, image processor), saved into a folder like a real one."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from genserve.word_tokenizer import word_tokenizer

SPECIALS = [
    "<unk>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<image>",
]
WORDS = (
    "system user assistant you are a helpful what is in the image describe this picture and "
    "compare two images color of shape how many ? . , red blue green square circle left right"
).split()
VOCAB_SIZE = 300

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% else %}IMAGE{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(folder: Path, image: str = QWEN_IMAGE):
    # Byte-level words ("Ġ" = a leading space, "Ċ" = newline), so decoding is exact.
    pieces = SPECIALS + ["Ċ"] + [p for w in WORDS for p in (w, "Ġ" + w)]
    pieces += [f"Ġw{i}" for i in range(len(pieces), VOCAB_SIZE)]
    fast = word_tokenizer(
        pieces,
        unk="<unk>",
        split="bytelevel",
        lowercase=False,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[2:],
    )
    fast.chat_template = CHAT_TEMPLATE.replace("IMAGE", image)
    fast.save_pretrained(folder)
    return fast


def make_tiny_qwen2_vl(
    folder: Path,
    arch: str = "qwen2_vl",
    seed: int = 0,
    vision: dict | None = None,
    text_overrides: dict | None = None,
    max_pixels: int = 28 * 28 * 64,
) -> Path:
    """A 2-layer Qwen2-VL (or Qwen2.5-VL) with a 2-block vision tower, saved to `folder`."""
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        eos_token_id=ids["<|im_end|>"],
        bos_token_id=None,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    text.update(text_overrides or {})
    vis = dict(
        depth=2,
        hidden_size=64,
        num_heads=4,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        initializer_range=0.2,
    )
    if arch == "qwen2_vl":
        vis.update(embed_dim=32, mlp_ratio=2)
        cfg_cls, model_cls = tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration
    else:
        vis.update(
            intermediate_size=64, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1]
        )
        cfg_cls, model_cls = tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration
        vis["hidden_size"] = 32
    vis.update(vision or {})
    cfg = cfg_cls(
        text_config=text,
        vision_config=vis,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        eos_token_id=ids["<|im_end|>"],
    )
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():  # make the q/k/v biases matter
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.normal_(std=0.2)
    model.save_pretrained(folder, safe_serialization=True)
    image_processor(folder, max_pixels)
    return folder


def image_processor(folder: Path, max_pixels: int = 28 * 28 * 64):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=max_pixels)
    proc.save_pretrained(folder)
    return proc


def png_bytes(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def image_token(cfg) -> int:
    return cfg.image_token_index if cfg.model_type == "llava" else cfg.image_token_id


def image_token_counts(cfg, processed) -> list[int]:
    """Tokens each image becomes, as HF's processors count them."""
    if cfg.model_type == "llava":
        v = cfg.vision_config
        n = (v.image_size // v.patch_size) ** 2 + (v.model_type == "clip_vision_model")
        n -= cfg.vision_feature_select_strategy == "default"
        return [n] * len(processed["pixel_values"])
    merge = cfg.vision_config.spatial_merge_size
    return [int(g.prod() // merge**2) for g in processed["image_grid_thw"]]


def hf_reference(
    folder: Path, ids: list[int], images: list[bytes], max_new_tokens: int = 32, model=None
) -> list[int]:
    """Greedy tokens of Hugging Face transformers for a prompt whose image placeholders are
    single tokens (expanded here the way HF's processor does it)."""
    import transformers as tf
    from PIL import Image
    from transformers import AutoImageProcessor

    cfg = tf.AutoConfig.from_pretrained(folder)
    if model is None:
        model = tf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    kwargs = {}
    expanded = list(ids)
    if images:
        proc = AutoImageProcessor.from_pretrained(folder)
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        out = proc(images=pil, return_tensors="np")
        counts = image_token_counts(cfg, out)
        expanded, k = [], 0
        for t in ids:
            if t == image_token(cfg):
                expanded += [t] * counts[k]
                k += 1
            else:
                expanded.append(t)
        kwargs = dict(pixel_values=torch.from_numpy(out["pixel_values"]))
        if "image_grid_thw" in out:
            kwargs["image_grid_thw"] = torch.from_numpy(out["image_grid_thw"])
    inp = torch.tensor([expanded])
    if cfg.model_type != "llava":
        kwargs["mm_token_type_ids"] = (inp == image_token(cfg)).int()
    with torch.no_grad():
        gen = model.generate(
            input_ids=inp,
            attention_mask=torch.ones_like(inp),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **kwargs,
        )
    return gen[0, len(expanded) :].tolist()


def make_tiny_llava(folder: Path, tower: str = "clip", text: str = "llama", seed: int = 0) -> Path:
    """A 2-layer LLaVA: CLIP or SigLIP tower (56 px, 14 px patches), projector, Llama or
    Qwen2 decoder."""
    import transformers as tf
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder, image="<image>")
    text_cfg = dict(
        model_type=text,
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    vision_cfg = dict(
        model_type="clip_vision_model" if tower == "clip" else "siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=56,
        patch_size=14,
    )
    cfg = tf.LlavaConfig(
        text_config=text_cfg,
        vision_config=vision_cfg,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default" if tower == "clip" else "full",
        vision_feature_layer=-2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and name.endswith("proj.bias"):
                p.normal_(std=0.2)
            if "multi_modal_projector" in name:
                p.normal_(std=0.3)
    model.save_pretrained(folder, safe_serialization=True)
    CLIPImageProcessorPil(
        size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
    ).save_pretrained(folder)
    return folder
