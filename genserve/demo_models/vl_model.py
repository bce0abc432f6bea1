"""`shapes-vl`: the vision-language demo model, a LLaVA (Hugging Face
`LlavaForConditionalGeneration`) that reads pictures of the shapes world.

A CLIP vision tower over the picture resized to 48x48 (8-pixel patches: 36 image tokens), the
LLaVA projector, and a small Llama decoder over a word-level tokenizer whose vocabulary is the
world's words plus the questions it is taught (`vl_data.py`). Each word has a plain and a
"Ġ"-prefixed (leading space) form, byte-level like GPT-2's, so decoding gives back the exact
text. The chat template is ChatML's; an image part renders as the single `<image>` token the
runtime expands to the image's 36 tokens.
"""

from __future__ import annotations

from pathlib import Path

from genserve.demo_models.world import VOCAB
from genserve.word_tokenizer import word_tokenizer

MODEL_NAME = "shapes-vl"
WEIGHTS_PATH = Path(__file__).parent / "weights" / MODEL_NAME

IMAGE_TOKEN = "<image>"
EOS_TOKEN = "<|im_end|>"
SPECIALS = ["<unk>", "<pad>", "<|im_start|>", EOS_TOKEN, IMAGE_TOKEN]
# Words of the questions (vl_data.QUESTIONS) and roles, besides the world's own words.
EXTRA_WORDS = (
    "user assistant system describe the image this picture what is in do you see it caption "
    "one sentence colour color shape which kind of where placed tell me please"
).split()
PUNCTUATION = [".", "?", "!", ":"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% else %}<image>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# 48 px in 8-pixel patches: each cell of the world's 3x3 position grid is exactly 2x2 patches,
# so a shape always sits on the same patch corner whatever its cell. At 32 px (16 tokens) the
# cells (10.7 px) cut the patches differently in each cell and the tower took several times
# longer to tell circles from squares; at 64 px the 64 tokens cost 4x per step.
IMAGE_SIZE = 48
PATCH_SIZE = 8
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2  # CLS dropped ("default" strategy)
VISION_CONFIG = dict(
    model_type="clip_vision_model",
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
)
TEXT_CONFIG = dict(
    model_type="llama",
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def vocabulary() -> list[str]:
    words = sorted(set(VOCAB) | set(EXTRA_WORDS)) + PUNCTUATION
    pieces = list(SPECIALS) + ["Ċ"]
    for w in words:
        pieces.append(w)
        if w.isalpha():
            pieces.append("Ġ" + w)
    return pieces


def build_tokenizer():
    """Word-level, lower-cased, byte-level pieces (exact decoding); unknown words -> <unk>."""
    fast = word_tokenizer(
        vocabulary(),
        unk="<unk>",
        split="bytelevel",
        pad_token="<pad>",
        eos_token=EOS_TOKEN,
        additional_special_tokens=SPECIALS[2:],
        model_max_length=TEXT_CONFIG["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_image_processor():
    """CLIP's PIL image processor, resizing any picture to 48x48 (no crop: a non-square
    picture is squeezed, so a shape's position keeps its meaning)."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_center_crop=False,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def build_model(tokenizer):
    """A fresh (untrained) `LlavaForConditionalGeneration` for `tokenizer`."""
    import transformers as tf

    text = dict(
        TEXT_CONFIG,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    cfg = tf.LlavaConfig(
        text_config=text,
        vision_config=dict(VISION_CONFIG),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    model = tf.LlavaForConditionalGeneration(cfg)
    model.generation_config.eos_token_id = text["eos_token_id"]
    model.generation_config.pad_token_id = text["pad_token_id"]
    return model
