"""The tiny checkpoints `test_served_checkpoints.py` serves in one `genserve serve`: one folder per
pre-quantized format and per 2026 LLM family, each written with the test tokenizer (its vocab,
its chat template) so that a chat request reaches it, in a folder whose name is its model id, and
transformers' greedy answer for each (its own reading of the folder where it dequantizes the
format on a CPU, else the plain float32 folder holding the weights the quantizer's integers and
scales stand for)."""

from __future__ import annotations

import dataclasses
import io
import shutil
from pathlib import Path

import torch

from tests.srt import prequant_checkpoints as pc
from tests.srt.vlm_models import SPECIALS, VOCAB_SIZE, build_tokenizer

# Each pre-quantized format on the architecture test_prequantized.py writes it for.
FORMATS = ("fp8-block", "fp8-tensor", "ct-w8a8-int8", "ct-fp8", "ct-w4a16", "gptq", "awq")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    folder: Path  # what the server serves; its name is the model id
    reference: Path  # what transformers reads for the expected answer
    # How transformers reads `reference`: "plain", or dequantizing "fp8" / "ct" (compressed-
    # tensors) / "mxfp4"; "vlm" / "gemma3": a vision model (an image request).
    reader: str
    architecture: str
    quantization: str | None  # how /get_model_info's checkpoint_quantization starts


def _token_ids(folder: Path) -> dict[str, int]:
    tok = build_tokenizer(folder)
    return {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}


def _text_tiny(ids: dict[str, int]) -> dict:
    from tests.srt.hf_equality import TINY

    return {
        **TINY,
        "vocab_size": VOCAB_SIZE,
        "eos_token_id": ids["<|im_end|>"],
        "bos_token_id": None,
        "pad_token_id": ids["<|endoftext|>"],
    }


def _plain(folder: Path, arch: str) -> Path:
    import transformers as tf

    from tests.srt.hf_equality import save_tiny

    tiny = _text_tiny(_token_ids(folder))
    if arch == "llama":
        return save_tiny(tf.LlamaForCausalLM, tf.LlamaConfig(**tiny), folder)
    return save_tiny(tf.Qwen3ForCausalLM, tf.Qwen3Config(**tiny, head_dim=16), folder)


def _prequantized(root: Path, name: str) -> Checkpoint:
    from tests.srt.test_prequantized import CASES

    arch, quantize, qconfig, reader = CASES[name]
    plain = _plain(root / f"{name}-plain", arch)
    quantized, dequantized = pc.write_pair(plain, root / f"{name}-pair", qconfig, quantize)
    folder = root / name
    shutil.move(quantized, folder)
    architecture = "LlamaForCausalLM" if arch == "llama" else "Qwen3ForCausalLM"
    # GPTQ / AWQ: transformers needs GPU-only packages for them. W4A16: transformers multiplies
    # its bfloat16 scales in bfloat16, one bfloat16 step off the weights genserve (and the
    # float32 folder) hold, enough to move a greedy token of the tiny model.
    if reader is None or "w4a16" in name:
        return Checkpoint(folder, dequantized, "plain", architecture, qconfig["quant_method"])
    return Checkpoint(folder, folder, reader, architecture, qconfig["quant_method"])


def _gpt_oss_mxfp4(root: Path) -> Checkpoint:
    import transformers as tf

    from tests.srt.hf_equality import save_tiny
    from tests.srt.models.test_gpt_oss import gpt_oss_config, write_mxfp4

    plain = root / "gpt-oss-plain"
    ids = _token_ids(plain)
    cfg = gpt_oss_config(vocab_size=VOCAB_SIZE, eos_token_id=ids["<|im_end|>"], bos_token_id=None)
    save_tiny(tf.GptOssForCausalLM, cfg, plain)
    quantized, _ = write_mxfp4(plain, root / "gpt-oss-pair")
    for f in plain.iterdir():  # the tokenizer files
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, quantized / f.name)
    folder = root / "gpt-oss-mxfp4"
    shutil.move(quantized, folder)
    return Checkpoint(folder, folder, "mxfp4", "GptOssForCausalLM", "mxfp4")


def _deepseek(root: Path, version: int) -> Checkpoint:
    import transformers as tf

    from tests.srt.test_deepseek_mla import save_deepseek, v2_config, v3_config

    folder = root / f"deepseek-v{version}"
    tiny = _text_tiny(_token_ids(folder))
    cfg = v2_config() if version == 2 else v3_config()
    for key in ("vocab_size", "eos_token_id", "bos_token_id", "pad_token_id"):
        setattr(cfg, key, tiny[key])
    cls = tf.DeepseekV2ForCausalLM if version == 2 else tf.DeepseekV3ForCausalLM
    save_deepseek(cls, cfg, folder, seed=version - 2)
    return Checkpoint(folder, folder, "plain", cls.__name__, None)


def _vlms(root: Path) -> list[Checkpoint]:
    from tests.srt.vlm_models_2026 import QWEN3_VL_MOE, make_tiny_gemma3, make_tiny_qwen3_vl

    qwen3_vl = make_tiny_qwen3_vl(root / "qwen3-vl")
    qwen3_vl_moe = make_tiny_qwen3_vl(root / "qwen3-vl-moe", moe=QWEN3_VL_MOE)
    gemma3 = make_tiny_gemma3(root / "gemma3-vision")
    return [
        Checkpoint(qwen3_vl, qwen3_vl, "vlm", "Qwen3VLForConditionalGeneration", None),
        Checkpoint(qwen3_vl_moe, qwen3_vl_moe, "vlm", "Qwen3VLMoeForConditionalGeneration", None),
        Checkpoint(gemma3, gemma3, "gemma3", "Gemma3ForConditionalGeneration", None),
    ]


def write_checkpoints(root: Path) -> dict[str, Checkpoint]:
    """Every served checkpoint under `root`, by model id."""
    made = [_prequantized(root, name) for name in FORMATS]
    made += [_gpt_oss_mxfp4(root), _deepseek(root, 2), _deepseek(root, 3), *_vlms(root)]
    return {c.folder.name: c for c in made}


def load_text_model(ckpt: Checkpoint):
    import transformers as tf

    kwargs = {}
    if ckpt.reader == "fp8":
        from tests.srt.test_prequantized import transformers_reference

        return transformers_reference(ckpt.reference, "fp8")
    if ckpt.reader == "ct":
        kwargs["quantization_config"] = tf.CompressedTensorsConfig(dequantize=True)
    elif ckpt.reader == "mxfp4":
        kwargs["quantization_config"] = tf.Mxfp4Config(dequantize=True)
    return tf.AutoModelForCausalLM.from_pretrained(
        ckpt.reference, dtype=torch.float32, **kwargs
    ).eval()


def text_answer(ckpt: Checkpoint, messages: list[dict], max_tokens: int) -> str:
    """transformers' greedy answer to `messages`, `max_tokens` tokens long (no stop at EOS, as
    the server's `ignore_eos`), decoded without special tokens."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(ckpt.folder)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    inp = torch.tensor([ids])
    with torch.no_grad():
        out = load_text_model(ckpt).generate(
            inp,
            attention_mask=torch.ones_like(inp),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    new = out[0, len(ids) :].tolist()
    assert len(new) == max_tokens and len(set(new)) >= 3, f"degenerate reference output {new}"
    return tok.decode(new, skip_special_tokens=True)


def image_answer(ckpt: Checkpoint, image: bytes, text: str, max_tokens: int) -> str:
    """transformers' greedy answer to one user turn of `image` then `text`."""
    import transformers as tf

    from tests.srt.vlm_models import hf_reference
    from tests.srt.vlm_models_2026 import gemma3_reference

    tok = tf.AutoTokenizer.from_pretrained(ckpt.folder)
    content = [{"type": "image"}, {"type": "text", "text": text}]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    ids = tok.encode(prompt)
    reference = gemma3_reference if ckpt.reader == "gemma3" else hf_reference
    new = reference(ckpt.reference, ids, [image], max_tokens)
    assert len(set(new)) >= 3, f"degenerate reference output {new}"
    return tok.decode(new, skip_special_tokens=True)


def decode_png(data: bytes):
    """The RGB pixels [H, W, 3] of a PNG."""
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def decode_mp4(path: Path):
    """The frames [N, H, W, 3] of an MP4 (ffmpeg's decoding)."""
    import imageio_ffmpeg
    import numpy as np

    reader = imageio_ffmpeg.read_frames(str(path))
    width, height = next(reader)["size"]
    return np.stack([np.frombuffer(f, np.uint8).reshape(height, width, 3) for f in reader])
