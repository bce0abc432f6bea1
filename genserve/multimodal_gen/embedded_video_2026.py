"""Embedded tiny video pipelines of the 2025-26 families (Wan 2.2, HunyuanVideo 1.5): real
diffusers pipelines built from tiny configs with seeded random weights and inline tokenizers,
nothing downloaded. Built through `embedded.build_embedded`; runs in the worker (imports torch).
"""

from __future__ import annotations

from genserve.multimodal_gen.embedded import (
    _tiny_t5_encoder,
    _tiny_wan_parts,
    _tiny_wan_transformer,
    text_tokenizer,
)


def _tiny_wan22_vae():
    from diffusers import AutoencoderKLWan

    # The Wan 2.2 VAE's layout: residual blocks, a 2x2 pixel patch (12 = 3 * 2 * 2 channels in
    # and out) before 3 downsamplings, so 16x in space (and 4x in time) overall.
    return AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=8,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        latents_mean=[0.0] * 8,
        latents_std=[1.0] * 8,
    )


def build_tiny_wan22_ti2v():
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    # Wan 2.2 TI2V-5B's text-to-video: the 2.2 VAE (sizes multiple of 32) and one timestep
    # per latent token (`expand_timesteps`).
    return WanPipeline(
        tokenizer=text_tokenizer(bos=False),
        text_encoder=_tiny_t5_encoder(32, umt5=True),
        vae=_tiny_wan22_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        transformer=_tiny_wan_transformer(8, 8, num_layers=2),
        expand_timesteps=True,
    )


def build_tiny_wan22_a14b():
    from diffusers import WanPipeline

    # Wan 2.2 A14B: the 2.1 VAE and two experts of the same shape (their own random weights);
    # `transformer` runs the steps at t >= 0.875 * 1000, `transformer_2` the rest.
    parts = _tiny_wan_parts()
    return WanPipeline(**parts, transformer_2=_tiny_wan_transformer(4, 4, num_layers=2),
                       boundary_ratio=0.875)


# Qwen's chat markup, as Qwen2.5-VL's tokenizer renders it. HunyuanVideo 1.5 drops the first
# 108 tokens of the encoded template (the system message and the user marker); here the
# system message is rendered as 100 one-token marks, so those 108 tokens are exactly it (3
# before it, 5 after) and the prompt's words are what remains.
_HUNYUAN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.role == 'system' %}{{ '.' * 100 }}{% else %}{{ message.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tiny_qwen25_text_model(vocab_size: int):
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    # Two layers: the pipeline reads the hidden states of the third layer from the end.
    config = Qwen2_5_VLTextConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        rope_scaling={"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},
        rope_theta=1000000.0,
        bos_token_id=None,
        eos_token_id=2,  # <|im_end|>
    )
    return Qwen2_5_VLTextModel(config).eval()


def build_tiny_hunyuan_video15():
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import ByT5Tokenizer

    from genserve.multimodal_gen.embedded_qwen import _vocab_size, qwen_tokenizer

    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = _HUNYUAN_CHAT_TEMPLATE
    # Latents: 4 channels at 1/16 space and 1/4 time; the transformer reads them with the
    # (zero, for text-to-video) condition latents and mask: 4 + 4 + 1 channels.
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        text_embed_dim=32,
        text_embed_2_dim=32,
        image_embed_dim=16,
        rope_axes_dim=(4, 6, 6),
        task_type="t2v",
    )
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=4,
        block_out_channels=(8, 8, 8, 8, 8),
        layers_per_block=1,
        spatial_compression_ratio=16,
        temporal_compression_ratio=4,
        scaling_factor=0.7,
    )
    # ByT5 encodes only quoted text of a prompt (glyphs); its tokenizer needs no files.
    return HunyuanVideo15Pipeline(
        text_encoder=_tiny_qwen25_text_model(_vocab_size()),
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder_2=_tiny_t5_encoder(32),
        tokenizer_2=ByT5Tokenizer(),
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
