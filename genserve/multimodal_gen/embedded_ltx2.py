"""The embedded tiny LTX-2 pipeline (`tiny-ltx2`): seeded random weights, a one-layer Gemma 3
text encoder (with a tiny SigLIP tower its class requires) and the word-level tokenizer, the
connectors, a tiny video VAE, and the audio VAE and vocoder the pipeline's class requires
(genserve serves the video only). Built through `embedded.build_embedded`; runs in the worker
(imports torch).
"""

from __future__ import annotations

from genserve.multimodal_gen.embedded import _vocab_size, text_tokenizer

_HIDDEN = 32


def _gemma3_encoder():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(
            vocab_size=_vocab_size(),
            hidden_size=_HIDDEN,
            intermediate_size=_HIDDEN,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=3,
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        image_token_index=2,
    )
    return Gemma3ForConditionalGeneration(config).eval()


def build_tiny_ltx2():
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    transformer = LTX2VideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=2,
        caption_channels=_HIDDEN,
        rope_double_precision=False,
        rope_type="split",
    )
    # The text states of every layer (embeddings + 1 layer) are stacked: 2 * 32 channels in.
    connectors = LTX2TextConnectors(
        caption_channels=_HIDDEN,
        text_proj_in_factor=2,
        video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        rope_type="split",
    )
    # 4 latent channels; 8x space and time (8k+1 frames), as the real VAE's 32x space is more
    # than a tiny test picture needs.
    vae = AutoencoderKLLTX2Video(
        latent_channels=4,
        block_out_channels=(8, 8, 8),
        decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1),
        down_block_types=("LTX2VideoDownBlock3D",) * 3,
        spatio_temporal_scaling=(True, True, True),
        decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False,) * 4,
        downsample_type=("spatiotemporal",) * 3,
        upsample_type=("spatiotemporal",) * 3,
        upsample_residual=(False,) * 3,
        upsample_factor=(1,) * 3,
        patch_size=1,
        decoder_causal=False,
    )
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        ch_mult=(1,),
        num_res_blocks=1,
        resolution=32,
        latent_channels=2,
        mel_bins=8,
    )
    vocoder = LTX2Vocoder(
        in_channels=2 * 8,
        hidden_channels=32,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=16000,
    )
    tokenizer = text_tokenizer()
    tokenizer.padding_side = "left"  # as Gemma's
    return LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=_gemma3_encoder(),
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )
