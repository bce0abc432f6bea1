"""The embedded tiny Qwen-Image pipeline (`tiny-qwen-image`): seeded random weights, a
Qwen2.5-VL text encoder of one layer, and a word-level tokenizer that knows
Qwen's chat markers. Built through `embedded.build_embedded`; runs in the worker (imports torch).

The pipeline wraps a prompt in a chat template and drops its first 34 tokens from the encoder's
output. The tokenizer splits the template the way Qwen's
own does (each newline, word and punctuation mark one token; the markers one token each), so
34 tokens are exactly the system part and the user marker, and the prompt's words are what
remains.

`tiny-qwen-image-edit` is the same pipeline with the reference image read by transformers'
`Qwen2VLProcessor`. Its default image processor and its video processor need torchvision,
which genserve does not install; the edit pipeline only ever calls the processor on text and
images, so it is built from the PIL image processor and no video processor.
"""

from __future__ import annotations

from genserve.multimodal_gen.embedded import _VOCAB_WORDS
from genserve.word_tokenizer import word_tokenizer

_MARKERS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_HIDDEN = 32


def qwen_tokenizer():
    """Words of the embedded vocabulary plus Qwen's chat markers (one token each); every
    newline, word and punctuation mark is one token, spaces are dropped."""
    return word_tokenizer([*_MARKERS, "[UNK]", "\n", *_VOCAB_WORDS], unk="[UNK]",
                          split="words-and-marks", markers=_MARKERS, model_max_length=1024,
                          pad_token="<|endoftext|>", eos_token="<|im_end|>")


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
        tokenizer=qwen_tokenizer(),
        scheduler=FlowMatchEulerDiscreteScheduler(
            base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
            shift_terminal=0.02, use_dynamic_shifting=True, time_shift_type="exponential"),
    )


def build_tiny_qwen_image():
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(**_parts())


def _edit_processor(tokenizer):
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2-VL's processor for text and images only. transformers checks each sub-
        processor named in `__init__` against its auto mapping, and the video mapping cannot
        be read without torchvision; naming no video processor leaves it out."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = "<|image_pad|>"
            self.video_token = "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    # At most 4x4 merged patches (2x2 patches of 14 pixels each): the pipeline hands the
    # processor a ~1024x1024 picture, which becomes 16 image tokens for the tiny vision tower.
    patch = 14 * 2
    image_processor = Qwen2VLImageProcessorPil(min_pixels=patch * patch,
                                               max_pixels=16 * patch * patch)
    return ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)


def build_tiny_qwen_image_edit():
    from diffusers import QwenImageEditPipeline

    parts = _parts()
    return QwenImageEditPipeline(**parts, processor=_edit_processor(parts["tokenizer"]))
