"""Embedded offline diffusion models: real diffusers pipelines built from tiny configs with seeded
random weights and an inline word-level tokenizer. Nothing is downloaded.

They draw noise-like pictures (the weights are random) but exercise every code path of the real
families: text encoding, the transformer denoising loop, the VAE, batching, caching and previews.
Runs in the worker process (imports torch).
"""

from __future__ import annotations

import threading

import torch

from genserve.multimodal_gen.named_models import DIFFUSION_MODELS
from genserve.named_models import locate
from genserve.word_tokenizer import word_tokenizer

_VOCAB_WORDS = (
    "a an the of and with in on at to red green blue yellow white black orange purple cat dog "
    "bird car tree house sky sea sun moon city forest mountain river flower portrait photo "
    "painting video walking running flying small big bright dark night day"
).split()

_cache: dict[str, object] = {}
_lock = threading.Lock()


def text_tokenizer(bos: bool = True):
    """The embedded pipelines' tokenizer: words of `_VOCAB_WORDS`, lower-cased, unknown words ->
    [UNK]; ends every prompt with </s> (and starts it with <s> when `bos`): the encoders pool /
    attend up to the end-of-text token, as CLIP and T5 do."""
    specials = ["<pad>", "</s>", "[UNK]"] + (["<s>"] if bos else [])
    extra = {"bos_token": "<s>"} if bos else {}
    return word_tokenizer(specials + list(_VOCAB_WORDS), unk="[UNK]",
                          template=("<s> " if bos else "") + "$A </s>", model_max_length=16,
                          pad_token="<pad>", eos_token="</s>", **extra)


def _vocab_size() -> int:
    return len(_VOCAB_WORDS) + 4


def _tiny_clip_encoder(hidden: int, with_projection: bool = False):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=_vocab_size(),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
        projection_dim=hidden,
        bos_token_id=3,
        eos_token_id=1,
        pad_token_id=0,
    )
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(config).eval()


def _tiny_t5_encoder(hidden: int, umt5: bool = False):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    cfg_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    config = cfg_cls(
        vocab_size=_vocab_size(),
        d_model=hidden,
        d_kv=hidden // 2,
        d_ff=2 * hidden,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return model_cls(config).eval()


def _tiny_flux_parts(in_channels: int = 16, out_channels: int | None = None) -> dict:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    # Latents: 4 channels at 1/8 resolution (as real Flux's VAE: size multiple of 16), packed
    # 2x2 into 16-channel tokens. Fill adds the masked image's tokens and the packed mask.
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=in_channels,
        out_channels=out_channels,
        num_layers=1,
        num_single_layers=4,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 6, 6],
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=_tiny_clip_encoder(32),
        tokenizer=text_tokenizer(),
        text_encoder_2=_tiny_t5_encoder(32),
        tokenizer_2=text_tokenizer(bos=False),
        transformer=transformer,
    )


def build_tiny_flux():
    from diffusers import FluxPipeline

    return FluxPipeline(**_tiny_flux_parts())


def build_tiny_flux_kontext():
    from diffusers import FluxKontextPipeline

    # The reference image's tokens join the sequence: the same transformer shape as Flux.
    return FluxKontextPipeline(**_tiny_flux_parts())


def build_tiny_flux_fill():
    from diffusers import FluxFillPipeline

    # Per token: 16 noisy + 16 masked-image channels + the 8x8 mask pixels of its 2x2 latent
    # patch (4 * 64), as FLUX.1 Fill's 64 + 64 + 256.
    return FluxFillPipeline(**_tiny_flux_parts(in_channels=16 + 16 + 256, out_channels=16))


def _tiny_wan_transformer(in_channels: int, out_channels: int, num_layers: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=out_channels,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def _tiny_wan_parts(in_channels: int = 4) -> dict:
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

    transformer = _tiny_wan_transformer(in_channels, 4, num_layers=4)
    # Wan's VAE: 4x temporal (hence 4k+1 frames) and 8x spatial compression.
    vae = AutoencoderKLWan(
        base_dim=4,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    return dict(
        tokenizer=text_tokenizer(bos=False),
        text_encoder=_tiny_t5_encoder(32, umt5=True),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=transformer,
    )


def build_tiny_wan():
    from diffusers import WanPipeline

    return WanPipeline(**_tiny_wan_parts())


def build_tiny_wan_i2v():
    from diffusers import WanImageToVideoPipeline

    # Wan 2.2 image-to-video without a CLIP image encoder: the transformer reads the noisy
    # latents, the encoded first frame (4 channels) and the frame mask (4, one per VAE time
    # step) stacked on the channel axis.
    return WanImageToVideoPipeline(**_tiny_wan_parts(in_channels=4 + 4 + 4))


def build_tiny_helios():
    from diffusers import HeliosPipeline, HeliosScheduler

    return HeliosPipeline(
        **_tiny_helios_parts(),
        scheduler=HeliosScheduler(stage_range=[0, 1], stages=1, use_dynamic_shifting=True),
    )


def build_tiny_helios_pyramid():
    from diffusers import HeliosPyramidPipeline, HeliosScheduler

    # Three pyramid stages (64x64 pixels: 2x2, 4x4 then 8x8 latents), UniPC. The
    # default gamma (1/3) makes the 2x2 block-noise covariance singular in float32 (cholesky
    # fails on a CPU); 1/4 keeps it positive definite.
    return HeliosPyramidPipeline(**_tiny_helios_parts(), scheduler=HeliosScheduler(gamma=0.25))


def build_tiny_helios_distilled():
    from diffusers import HeliosDMDScheduler, HeliosPyramidPipeline

    # The few-step distilled checkpoints: the DMD scheduler, no guidance.
    return HeliosPyramidPipeline(**_tiny_helios_parts(),
                                 scheduler=HeliosDMDScheduler(gamma=0.25), is_distilled=True)


def _tiny_helios_parts() -> dict:
    from diffusers import AutoencoderKLWan, HeliosTransformer3DModel

    # Helios: a Wan-style transformer that also reads the history latents through its
    # short / mid / long patch embeddings; Wan's VAE (4x time, 8x space).
    transformer = HeliosTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_dim=(4, 4, 4),
        has_multi_term_memory_patch=True,
        guidance_cross_attn=True,
        zero_history_timestep=True,
    )
    vae = AutoencoderKLWan(
        base_dim=4,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    return dict(tokenizer=text_tokenizer(bos=False),
                text_encoder=_tiny_t5_encoder(32, umt5=True), vae=vae, transformer=transformer)


def _tiny_image_vae(latent_channels: int = 4, vae_class: type | None = None, **kwargs):
    """A 4-level, 8-wide image VAE (8x spatial compression): `AutoencoderKL`, or `vae_class`
    where a family has its own with the same arguments (FLUX.2's)."""
    from diffusers import AutoencoderKL

    return (vae_class or AutoencoderKL)(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8),
        layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4, sample_size=32,
        **kwargs,
    )


def build_tiny_sd3():
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
        pooled_projection_dim=64, out_channels=4,
    )
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_tiny_image_vae(use_quant_conv=False, use_post_quant_conv=False,
                            shift_factor=0.0609, scaling_factor=1.5035),
        text_encoder=_tiny_clip_encoder(32, with_projection=True),
        tokenizer=text_tokenizer(),
        text_encoder_2=_tiny_clip_encoder(32, with_projection=True),
        tokenizer_2=text_tokenizer(),
        text_encoder_3=_tiny_t5_encoder(32),
        tokenizer_3=text_tokenizer(bos=False),
        transformer=transformer,
    )


def build_tiny_sd():
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(16, 32), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=8,
    )
    return StableDiffusionPipeline(
        vae=_tiny_image_vae(), text_encoder=_tiny_clip_encoder(32),
        tokenizer=text_tokenizer(), unet=unet,
        scheduler=DDIMScheduler(steps_offset=1, clip_sample=False), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )


def build_tiny_sdxl():
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    # SDXL conditions the UNet on both encoders' penultimate states (32 + 32 channels) and, by
    # its micro-conditioning, on the pooled text (32) plus six size numbers (original size,
    # crop corner, target size) embedded in 8 channels each.
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(16, 32), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=64,
        attention_head_dim=8, norm_num_groups=8, use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 32,
    )
    return StableDiffusionXLPipeline(
        vae=_tiny_image_vae(scaling_factor=0.13025), text_encoder=_tiny_clip_encoder(32),
        text_encoder_2=_tiny_clip_encoder(32, with_projection=True),
        tokenizer=text_tokenizer(),
        tokenizer_2=text_tokenizer(), unet=unet,
        scheduler=EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012,
                                         beta_schedule="scaled_linear",
                                         timestep_spacing="leading", steps_offset=1),
        add_watermarker=False,
    )


def build_tiny_ltx():
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    transformer = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4,
        attention_head_dim=8, cross_attention_dim=32, num_layers=2, caption_channels=32,
    )
    # 8x temporal (8k+1 frames) and 32x spatial compression, as the real LTX VAE.
    vae = AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False),
        decoder_spatio_temporal_scaling=(True, True, True, False),
        decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4,
        upsample_factor=(1,) * 4, timestep_conditioning=False, patch_size=4, patch_size_t=1,
        encoder_causal=True, decoder_causal=False,
    )
    return LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
        text_encoder=_tiny_t5_encoder(32), tokenizer=text_tokenizer(bos=False),
        transformer=transformer,
    )


def build_embedded(name: str, seed: int = 0, shared: bool = True):
    """The embedded pipeline `name` (a builder row of `named_models`) with weights from torch
    seed `seed`, float32 on CPU. Shared: built once per process (later calls return the same
    instance); not shared: a new instance, for a model whose weights will be changed (LoRA
    adapters, quantization)."""
    row = DIFFUSION_MODELS.get(name)
    if row is None or row.kind != "builder":
        have = [r.name for r in DIFFUSION_MODELS.rows if r.kind == "builder"]
        raise KeyError(f"unknown embedded diffusion model {name!r}; have {have}")
    with _lock:
        if shared and name in _cache:
            return _cache[name]
        # A private generator stream, so building does not disturb the caller's RNG state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            pipe = locate(row.source)()
        pipe.set_progress_bar_config(disable=True)
        if shared:
            _cache[name] = pipe
        return pipe
