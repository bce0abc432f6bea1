"""LLaVA (CLIP or SigLIP tower + projector + Llama or Qwen2 decoder) through the Engine:
greedy tokens equal to Hugging Face transformers, several images batched with text prompts,
and the image-aware prefix cache."""

from __future__ import annotations

import pytest

from genserve import Engine
from tests.srt.vlm_models import hf_reference, make_tiny_llava, png_bytes

GREEDY = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=[("clip", "llama"), ("siglip", "qwen2")],
                ids=["clip-llama", "siglip-qwen2"])
def llava(request, tmp_path_factory):
    tower, text = request.param
    return make_tiny_llava(tmp_path_factory.mktemp(f"llava-{tower}"), tower, text)


def chat_ids(engine: Engine, parts: list) -> list[int]:
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return engine.tokenizer.encode(text)


def test_llava_greedy_equal_to_hf(llava):
    engine = Engine(str(llava), dtype="float32", max_total_tokens=4096)
    a, b, c = png_bytes(56, 56, 1), png_bytes(120, 80, 2), png_bytes(64, 100, 3)
    prompts = [
        (chat_ids(engine, [None, "what is in the image ?"]), [a]),
        (chat_ids(engine, ["compare", None, "and", None, "?"]), [b, c]),
        (chat_ids(engine, ["how many red square ?"]), None),
    ]
    outs = engine.generate(input_ids=[p for p, _ in prompts], image_data=[i for _, i in prompts],
                           sampling_params=GREEDY)
    for (ids, images), out in zip(prompts, outs):
        assert out["output_ids"] == hf_reference(llava, ids, images or [])
    # Same image and leading text again: its tokens come from the prefix cache.
    again = engine.generate(input_ids=chat_ids(engine, [None, "what is the color ?"]),
                            image_data=[a], sampling_params=GREEDY)
    image_end = prompts[0][0].index(engine.vision.rules.image_token_id)
    assert again["meta_info"]["cached_tokens"] > image_end + engine.vision.rules.tokens_per_image
    assert engine.server_info()["multimodal"]["images_encoded"] == 3
    engine.check_integrity()
