"""Tiny random-weight Qwen3-VL and Gemma 3 (vision) checkpoints in HF format, and Hugging Face's
greedy tokens for a prompt with images (the reference the engine must match)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.srt.vlm_models import SPECIALS, VOCAB_SIZE, build_tokenizer


def _scale_vision_heads(model: torch.nn.Module) -> None:
    with torch.no_grad():  # larger weights, so the image features move the greedy tokens
        for name, p in model.named_parameters():
            if "multi_modal_projector" in name or "merger" in name:
                p.normal_(std=0.3)


def make_tiny_qwen3_vl(folder: Path, seed: int = 0) -> Path:
    """A 3-layer Qwen3-VL with a 3-block tower whose blocks 0 and 1 feed DeepStack, and an
    interleaved M-RoPE section that gives every axis two frequencies."""
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
    cfg = tf.Qwen3VLConfig(
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
    model = tf.Qwen3VLForConditionalGeneration(cfg)
    _scale_vision_heads(model)
    model.save_pretrained(folder, safe_serialization=True)
    Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, min_pixels=32 * 32, max_pixels=32 * 32 * 16
    ).save_pretrained(folder)
    return folder
