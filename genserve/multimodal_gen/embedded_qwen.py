"""The embedded tiny Qwen-Image pipeline (`tiny-qwen-image`): seeded random weights, a
Qwen2.5-VL text encoder of one layer, and a word-level tokenizer that knows
Qwen's chat markers. Built through `embedded.build_embedded`; runs in the worker (imports torch).

The pipeline wraps a prompt in a chat template and drops its first 34 tokens from the encoder's
output. The tokenizer splits the template the way Qwen's
own does (each newline, word and punctuation mark one token; the markers one token each), so
34 tokens are exactly the system part and the user marker, and the prompt's words are what
remains.

There is no embedded Qwen-Image-Edit: its pipeline reads the reference image through
transformers' `Qwen2VLProcessor`, which in transformers 5 cannot be built without torchvision
(its video processor's base class), and genserve does not install torchvision.
"""

from __future__ import annotations

from genserve.multimodal_gen.embedded import _VOCAB_WORDS

_MARKERS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_HIDDEN = 32


def _qwen_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [*_MARKERS, "[UNK]", "\n", *_VOCAB_WORDS]
    vocab = {tok: i for i, tok in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    # Keep each newline, word and punctuation mark; drop spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n|\w+|[^\w\s]"), behavior="removed",
                                             invert=True)
    tok.add_special_tokens([AddedToken(m, normalized=False, special=True) for m in _MARKERS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1024,
                                   pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="[UNK]")


def _vocab_size() -> int:
    return len(_MARKERS) + 2 + len(_VOCAB_WORDS)


def _text_encoder():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {m: i for i, m in enumerate(_MARKERS)}
    config = Qwen2_5_VLConfig(
        text_config={
            "bos_token_id": None, "eos_token_id": ids["<|im_end|>"],
            "hidden_size": _HIDDEN, "intermediate_size": _HIDDEN, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": _vocab_size(),
            # head_dim 16: 8 rotary frequencies split over (time, height, width)
            "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default",
                             "type": "default"},
            "rope_theta": 1000000.0,
        },
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": _HIDDEN, "fullatt_block_indexes": [0]},
        vocab_size=_vocab_size(),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _parts() -> dict:
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
    )

    # 4 latent channels at 1/8 resolution (3 downsamplings, as the real VAE), patched 2x2 into
    # 16-channel tokens: sizes are multiples of 16.
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=_HIDDEN, axes_dims_rope=(8, 4, 4),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    return dict(
        transformer=transformer, vae=vae, text_encoder=_text_encoder(),
        tokenizer=_qwen_tokenizer(),
        scheduler=FlowMatchEulerDiscreteScheduler(
            base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
            shift_terminal=0.02, use_dynamic_shifting=True, time_shift_type="exponential"),
    )


def build_tiny_qwen_image():
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(**_parts())

