"""Embedded tiny video pipelines of the 2025-26 families (Wan 2.2, HunyuanVideo 1.5): real
diffusers pipelines built from tiny configs with seeded random weights and inline tokenizers,
nothing downloaded. Built through `embedded.build_embedded`; runs in the worker (imports torch).
"""

from __future__ import annotations

from genserve.multimodal_gen.embedded import _tiny_t5_encoder, _tiny_wan_parts, text_tokenizer


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


def _tiny_wan_transformer(channels: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=channels,
        out_channels=channels,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
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
        transformer=_tiny_wan_transformer(8),
        expand_timesteps=True,
    )


def build_tiny_wan22_a14b():
    from diffusers import WanPipeline

    # Wan 2.2 A14B: the 2.1 VAE and two experts of the same shape (their own random weights);
    # `transformer` runs the steps at t >= 0.875 * 1000, `transformer_2` the rest.
    parts = _tiny_wan_parts()
    return WanPipeline(**parts, transformer_2=_tiny_wan_transformer(4), boundary_ratio=0.875)
