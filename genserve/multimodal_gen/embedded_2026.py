"""The embedded tiny FLUX.2 (`tiny-flux2`, `tiny-flux2-klein`) and Z-Image (`tiny-z-image`)
pipelines: seeded random weights, decoder-only text encoders of a few channels and word-level
tokenizers with a chat template. Built through `embedded.build_embedded`; runs in the worker
(imports torch).

The pipelines read fixed hidden layers of their text encoders (FLUX.2: layers 10, 20 and 30 of
Mistral Small 3; Klein: 9, 18 and 27 of Qwen3; Z-Image: the second to last), so the tiny
encoders keep that many layers, each 16 channels wide. Their chat templates write the markup of
the real models' templates (Mistral's `[SYSTEM_PROMPT]` / `[INST]`, Qwen's `<|im_start|>`), so a
prompt is tokenized the way the pipelines expect; words outside the small vocabulary (the
system message of FLUX.2) become `[UNK]`.

The FLUX.2 VAE normalizes its patchified latents with batch-norm running statistics; the tiny
one gets statistics other than (0, 1), so a decode that skips or inverts them is visible.
"""

from __future__ import annotations

import torch

from genserve.multimodal_gen.embedded import _VOCAB_WORDS, _tiny_image_vae
from genserve.word_tokenizer import word_tokenizer

_HIDDEN = 16
_ROLES = ("system", "user", "assistant")

_MISTRAL_MARKERS = (
    "<pad>",
    "<s>",
    "</s>",
    "[IMG]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[INST]",
    "[/INST]",
)
# Content is a string or a list of {"type": "text", "text": ...} parts (FLUX.2 sends parts).
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.content is string %}{% set text = m.content %}"
    "{% else %}{% set text = m.content | selectattr('type', 'equalto', 'text') "
    "| map(attribute='text') | join('') %}{% endif %}"
    "{% if m.role == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m.role == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)

_QWEN_MARKERS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Qwen3's template: `enable_thinking=False` writes an empty thinking block after the
# assistant marker (FLUX.2 Klein), True leaves it open (Z-Image).
_QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def _chat_tokenizer(markers: tuple[str, ...], template: str, **specials):
    vocab = [*markers, "[UNK]", "\n", *_ROLES, *_VOCAB_WORDS]
    tok = word_tokenizer(
        vocab,
        unk="[UNK]",
        split="words-and-marks",
        markers=markers,
        model_max_length=1024,
        **specials,
    )
    tok.chat_template = template
    return tok, len(vocab)


def mistral_tokenizer():
    return _chat_tokenizer(
        _MISTRAL_MARKERS, _MISTRAL_TEMPLATE, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def qwen3_tokenizer():
    return _chat_tokenizer(
        _QWEN_MARKERS, _QWEN_TEMPLATE, pad_token="<|endoftext|>", eos_token="<|im_end|>"
    )


def _qwen3_config(vocab_size: int, layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=_HIDDEN,
        intermediate_size=_HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=vocab_size,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=2,
    )


def _mistral3_encoder(vocab_size: int):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    ids = {m: i for i, m in enumerate(_MISTRAL_MARKERS)}
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": vocab_size,
            "hidden_size": _HIDDEN,
            "intermediate_size": _HIDDEN,
            "max_position_embeddings": 1024,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "num_hidden_layers": 30,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000000.0,
            "sliding_window": None,
            "bos_token_id": ids["<s>"],
            "eos_token_id": ids["</s>"],
            "pad_token_id": ids["<pad>"],
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": _HIDDEN,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": _HIDDEN,
            "image_size": 28,
            "patch_size": 14,
            "num_channels": 3,
        },
        image_token_index=ids["[IMG]"],
        vision_feature_layer=-1,
    )
    return Mistral3ForConditionalGeneration(config).eval()


def _flux2_vae():
    from diffusers import AutoencoderKLFlux2

    # 4 latent channels at 1/8 resolution, patchified 2x2 into 16-channel tokens (the real VAE:
    # 32 channels, 128 per token): sizes are multiples of 16.
    vae = _tiny_image_vae(vae_class=AutoencoderKLFlux2, use_quant_conv=False,
                          use_post_quant_conv=False)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.4, 0.4, vae.bn.num_features))
        vae.bn.running_var.copy_(torch.linspace(0.25, 4.0, vae.bn.num_features))
    return vae


def _flux2_transformer(guidance_embeds: bool):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * _HIDDEN,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )


def build_tiny_flux2():
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline

    tokenizer, vocab_size = mistral_tokenizer()
    return Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0),
        vae=_flux2_vae(),
        text_encoder=_mistral3_encoder(vocab_size),
        tokenizer=tokenizer,
        transformer=_flux2_transformer(guidance_embeds=True),
    )


def build_tiny_flux2_klein():
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen3ForCausalLM

    # The base (undistilled) Klein: true classifier-free guidance, no guidance embedding.
    tokenizer, vocab_size = qwen3_tokenizer()
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0),
        vae=_flux2_vae(),
        text_encoder=Qwen3ForCausalLM(_qwen3_config(vocab_size, 27)).eval(),
        tokenizer=tokenizer,
        transformer=_flux2_transformer(guidance_embeds=False),
    )


def build_tiny_z_image():
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )
    from transformers import Qwen3Model

    tokenizer, vocab_size = qwen3_tokenizer()
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        qk_norm=True,
        cap_feat_dim=_HIDDEN,
        axes_dims=[8, 4, 4],
        axes_lens=[256, 32, 32],
    )
    with torch.no_grad():  # created with torch.empty
        transformer.x_pad_token.copy_(torch.randn_like(transformer.x_pad_token) * 0.1)
        transformer.cap_pad_token.copy_(torch.randn_like(transformer.cap_pad_token) * 0.1)
    # 4 latent channels at 1/8 resolution, patched 2x2 by the transformer: sizes are multiples
    # of 16, as the real model's (16 channels).
    vae = _tiny_image_vae(scaling_factor=0.3611, shift_factor=0.1159)
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # as Z-Image-Turbo's
        vae=vae,
        text_encoder=Qwen3Model(_qwen3_config(vocab_size, 2)).eval(),
        tokenizer=tokenizer,
        transformer=transformer,
    )
