"""Configs of the two demo models and their word-level tokenizer; where the trained weights live
(the streaming model's config is in stream_model.py)."""

from __future__ import annotations

from pathlib import Path

from genserve.demo_models.world import NUM_FRAMES, SIZE, VOCAB
from genserve.word_tokenizer import word_tokenizer

WEIGHTS_DIR = Path(__file__).parent / "weights"
KINDS = ("image", "video")
MODEL_NAMES = {"image": "shapes-image", "video": "shapes-video"}

# Transformer sizes (pixel space, 32x32): patch 4 gives an 8x8 token grid (patch 2 would be
# 16x16, four times the tokens, too slow to train on a CPU; docs/benchmarks.md).
TRANSFORMER_CONFIGS = {
    "image": dict(num_attention_heads=4, attention_head_dim=32, num_layers=6, patch_size=4),
    "video": dict(num_attention_heads=6, attention_head_dim=32, num_layers=6, patch_size=4),
}
# Both models are SD3's MMDiT, whose "pooled" text input drives every block's adaLN scale and
# shift; we feed it the whole prompt embedding flattened (one slot per token, see pipeline.py).
# Text reaches a freshly initialised DiT's tokens almost the same everywhere through attention,
# which is enough for colours but not for a direction (the shape must be somewhere else in every
# frame) or a shape's corners; through adaLN each word scales and shifts every block. The
# training runs behind this choice (and the cross-attention-only PixArt DiT it replaced) are in
# docs/benchmarks.md.
TEXT_DIM = 64
MAX_PROMPT_TOKENS = 16  # the longest grammar prompt is 11 tokens with </s>
# What the transformer outputs (see pipeline.py): the clean picture. The video's patches (16
# frames x 4x4 x 3 = 768 numbers) are wider than its tokens, so noise cannot pass through them;
# the image model (48 numbers a patch) predicts the picture too, so both take one path.
PREDICTION = {"image": "sample", "video": "sample"}
# Serving defaults: classifier-free guidance and denoising steps, chosen on the held-out prompts
# (evaluate.py). Clean-picture models overshoot with strong guidance, so the defaults are low
# (accuracy by guidance: docs/benchmarks.md).
DEFAULT_GUIDANCE = {"image": 1.5, "video": 3.0}
DEFAULT_STEPS = 8


def weights_path(kind: str) -> Path:
    return WEIGHTS_DIR / MODEL_NAMES[kind]


# The served folders, named by the rows of multimodal_gen/named_models.py.
IMAGE_WEIGHTS_PATH = weights_path("image")
VIDEO_WEIGHTS_PATH = weights_path("video")
STREAM_WEIGHTS_PATH = WEIGHTS_DIR / "shapes-stream"  # stream_train.py exports here by default


def build_tokenizer():
    """Word-level, lower-cased, punctuation split off; unknown words -> [UNK]; ends with </s>."""
    return word_tokenizer(["<pad>", "</s>", "[UNK]", *VOCAB], unk="[UNK]", template="$A </s>",
                          model_max_length=MAX_PROMPT_TOKENS, pad_token="<pad>", eos_token="</s>")


def build_pipeline(kind: str):
    """A fresh (untrained) demo pipeline of `kind` ("image" or "video")."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import T5Config, T5EncoderModel

    from genserve.demo_models.pipeline import ShapesImagePipeline, ShapesVideoPipeline

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    tokenizer = build_tokenizer()
    text_encoder = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=TEXT_DIM, d_kv=TEXT_DIM // 2, d_ff=2 * TEXT_DIM,
        num_layers=2, num_heads=2, relative_attention_num_buckets=8, dropout_rate=0.0,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    channels = 3 * (NUM_FRAMES if kind == "video" else 1)
    cfg = TRANSFORMER_CONFIGS[kind]
    width = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    transformer = SD3Transformer2DModel(
        in_channels=channels, out_channels=channels, sample_size=SIZE,
        joint_attention_dim=TEXT_DIM, caption_projection_dim=width,
        pooled_projection_dim=TEXT_DIM * MAX_PROMPT_TOKENS,
        pos_embed_max_size=SIZE // cfg["patch_size"], **cfg)
    cls = ShapesVideoPipeline if kind == "video" else ShapesImagePipeline
    return cls(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer,
               scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
               prediction=PREDICTION[kind])
