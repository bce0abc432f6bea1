"""Tiny random-weight Qwen3-VL and Gemma 3 (vision) checkpoints in HF format, and Hugging Face's
greedy tokens for a prompt with images (the reference the engine must match)."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from tests.srt.vlm_models import SPECIALS, VOCAB_SIZE, build_tokenizer


def _scale_vision_heads(model: torch.nn.Module) -> None:
    with torch.no_grad():  # larger weights, so the image features move the greedy tokens
        for name, p in model.named_parameters():
            if "multi_modal_projector" in name or "merger" in name:
                p.normal_(std=0.3)


# Qwen3-VL-MoE's decoder: 4 experts, 2 per token, layer 1 dense (`mlp_only_layers`). No
# expert matrix is square (2 * 48 != 64, 48 != 64), so the two stacked layouts differ in shape.
QWEN3_VL_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
)


def make_tiny_qwen3_vl(folder: Path, seed: int = 0, moe: dict | None = None) -> Path:
    """A 3-layer Qwen3-VL with a 3-block tower whose blocks 0 and 1 feed DeepStack, and an
    interleaved M-RoPE section that gives every axis two frequencies. `moe` (the decoder's
    expert fields, e.g. QWEN3_VL_MOE) makes it a Qwen3-VL-MoE."""
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=64,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 1],
        initializer_range=0.2,
    )
    text.update(moe or {})
    cfg_cls = tf.Qwen3VLMoeConfig if moe else tf.Qwen3VLConfig
    cfg = cfg_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        eos_token_id=ids["<|im_end|>"],
    )
    torch.manual_seed(seed)
    model_cls = tf.Qwen3VLMoeForConditionalGeneration if moe else tf.Qwen3VLForConditionalGeneration
    model = model_cls(cfg)
    _scale_vision_heads(model)
    model.save_pretrained(folder, safe_serialization=True)
    Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, min_pixels=32 * 32, max_pixels=32 * 32 * 16
    ).save_pretrained(folder)
    return folder


GEMMA_IMAGE = "<|vision_start|><image><|vision_end|>"


def make_tiny_gemma3(folder: Path, seed: int = 0) -> Path:
    """A 3-layer Gemma 3 (two sliding-window layers of window 8, one global)
    with a 2-layer SigLIP tower of 64 px images in 8 px patches, pooled to 16 tokens: each
    image is wider than the window, so both the image blocks and the windows shape the mask."""
    import transformers as tf
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder, image=GEMMA_IMAGE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        eos_token_id=ids["<|im_end|>"],
        bos_token_id=None,
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=64,
        patch_size=8,
    )
    cfg = tf.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=16,
        image_token_index=ids["<image>"],
        boi_token_index=ids["<|vision_start|>"],
        eoi_token_index=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(cfg)
    _scale_vision_heads(model)
    model.save_pretrained(folder, safe_serialization=True)
    Gemma3ImageProcessorPil(
        size={"height": 64, "width": 64}, do_pan_and_scan=False
    ).save_pretrained(folder)
    return folder


def gemma3_reference(
    folder: Path, ids: list[int], images: list[bytes], max_new_tokens: int = 24
) -> list[int]:
    """Greedy tokens of transformers' Gemma3ForConditionalGeneration, with each single image
    placeholder expanded and `token_type_ids` marking the image tokens (its prefill attends
    both ways within an image)."""
    import transformers as tf
    from PIL import Image
    from transformers import AutoImageProcessor

    cfg = tf.AutoConfig.from_pretrained(folder)
    model = tf.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    token = cfg.image_token_id
    expanded = [t for i in ids for t in ([i] * cfg.mm_tokens_per_image if i == token else [i])]
    inp = torch.tensor([expanded])
    kwargs = {"token_type_ids": (inp == token).long()}
    if images:
        proc = AutoImageProcessor.from_pretrained(folder)
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        kwargs["pixel_values"] = torch.from_numpy(
            proc(images=pil, return_tensors="np")["pixel_values"]
        )
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
