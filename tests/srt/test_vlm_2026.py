"""Qwen3-VL (DeepStack, interleaved M-RoPE), its MoE variant and Gemma 3 with its SigLIP tower
through the Engine: greedy tokens equal to Hugging Face transformers with images batched beside a
text-only prompt, the image-aware prefix cache, and a clear refusal of --tp."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from genserve import Engine
from genserve.srt.model_config import ModelConfig
from genserve.srt.model_runner import check_tensor_parallel, load_model
from genserve.srt.models.base import ModelKernels
from tests.srt.vlm_models import hf_reference, png_bytes
from tests.srt.vlm_models_2026 import (
    QWEN3_VL_MOE,
    gemma3_reference,
    make_tiny_gemma3,
    make_tiny_qwen3_vl,
)

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def chat_ids(engine: Engine, parts: list) -> list[int]:
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return engine.tokenizer.encode(text)


def greedy_batch_with_text(engine: Engine, third: tuple[int, int], reference):
    """Three prompts in one batch (one image; text only; two images, the second `third` in
    size), each equal to `reference(ids, images)`; returns the prompts and the first image."""
    a, b, c = png_bytes(64, 96, 1), png_bytes(128, 64, 2), png_bytes(*third, 3)
    prompts = [
        (chat_ids(engine, [None, "what is in the image ?"]), [a]),
        (chat_ids(engine, ["how many red square ?"]), None),
        (chat_ids(engine, ["compare", None, "and", None, "?"]), [b, c]),
    ]
    outs = engine.generate(
        input_ids=[p for p, _ in prompts],
        image_data=[i for _, i in prompts],
        sampling_params=GREEDY,
    )
    for (ids, images), out in zip(prompts, outs):
        assert out["output_ids"] == reference(ids, images or [])
    return prompts, a


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def qwen3_vl_moe(tmp_path_factory):
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_moe"), moe=QWEN3_VL_MOE)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_qwen3_vl_greedy_equal_to_hf_batched_with_text(family, request):
    folder = request.getfixturevalue(family)
    engine = Engine(str(folder), dtype="float32", max_total_tokens=2048)
    prompts, a = greedy_batch_with_text(
        engine, (96, 96), lambda ids, images: hf_reference(folder, ids, images, 24)
    )
    assert engine.server_info()["multimodal"]["images_encoded"] == 3
    # Same image and leading text: the image's KV comes from the prefix cache, and the
    # embeddings (with their DeepStack levels) are not encoded again.
    again = engine.generate(
        input_ids=chat_ids(engine, [None, "describe this picture ."]),
        image_data=[a],
        sampling_params=GREEDY,
    )
    first = prompts[0][0]
    image_end = first.index(engine.vision.rules.image_token_id) + 6  # 64x96 -> 2x3 tokens
    assert again["meta_info"]["cached_tokens"] >= image_end
    assert engine.server_info()["multimodal"]["images_encoded"] == 3
    cold = hf_reference(folder, chat_ids(engine, [None, "describe this picture ."]), [a], 24)
    assert again["output_ids"] == cold
    engine.check_integrity()


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_qwen3_vl_chunked_prefill_through_an_image(family, request):
    folder = request.getfixturevalue(family)
    whole = Engine(str(folder), dtype="float32", max_total_tokens=2048, disable_radix_cache=True)
    ids = chat_ids(whole, ["describe", None, "and", None, "?"])
    images = [png_bytes(128, 128, 3), png_bytes(160, 96, 2)]  # 16 and 15 tokens
    ref = whole.generate(input_ids=ids, image_data=images, sampling_params=GREEDY)
    # Chunks of 16 cut through both images: DeepStack rows must follow the spliced rows.
    chunked = Engine(str(folder), dtype="float32", max_total_tokens=2048, chunked_prefill_size=16)
    out = chunked.generate(input_ids=ids, image_data=images, sampling_params=GREEDY)
    assert out["output_ids"] == ref["output_ids"]
    assert chunked.scheduler.stats["prefill_batches"] >= 3
    chunked.check_integrity()


def test_qwen3_vl_moe_with_the_triton_moe_kernel(qwen3_vl_moe):
    """The decoder's experts through the Triton fused-MoE kernel (Triton's interpreter on a
    CPU) give transformers' greedy tokens too."""
    engine = Engine(str(qwen3_vl_moe), dtype="float32", max_total_tokens=1024, moe_kernel="triton")
    ids = chat_ids(engine, [None, "what is in the image ?"])
    image = png_bytes(64, 96, 1)
    out = engine.generate(input_ids=ids, image_data=[image], sampling_params=GREEDY)
    assert out["output_ids"] == hf_reference(qwen3_vl_moe, ids, [image], 24)
    engine.check_integrity()


def test_qwen3_vl_moe_reads_the_released_expert_layout(qwen3_vl_moe, tmp_path):
    """The released checkpoints store the stacked experts transposed ([experts, hidden,
    2 * inter] and [experts, inter, hidden]; transformers 5 saves [experts, 2 * inter, hidden]
    and [experts, hidden, inter]): both load into the same model, and a stacked tensor of
    neither shape is refused by name."""
    from safetensors.torch import load_file, save_file

    for f in qwen3_vl_moe.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    stacked = ("experts.gate_up_proj", "experts.down_proj")
    weights = load_file(str(qwen3_vl_moe / "model.safetensors"))
    released = {
        k: v.transpose(1, 2).contiguous() if k.endswith(stacked) else v for k, v in weights.items()
    }
    save_file(released, str(tmp_path / "model.safetensors"))
    config = ModelConfig.from_folder(qwen3_vl_moe)

    def load(folder):
        return load_model(config, folder, torch.device("cpu"), torch.float32, ModelKernels())

    saved, release = load(qwen3_vl_moe).state_dict(), load(tmp_path).state_dict()
    assert saved.keys() == release.keys()
    assert all(torch.equal(saved[k], release[k]) for k in saved)

    name = "model.language_model.layers.2.mlp.experts.gate_up_proj"
    released[name] = released[name][:, :, :-1].contiguous()
    save_file(released, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"weight '{name}' has shape \\(4, 64, 95\\)"):
        load(tmp_path)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


def test_gemma3_greedy_equal_to_hf_batched_with_text(gemma3):
    engine = Engine(str(gemma3), dtype="float32", max_total_tokens=2048)
    prompts, a = greedy_batch_with_text(
        engine, (40, 40), lambda ids, images: gemma3_reference(gemma3, ids, images)
    )
    # The same image after the same text: its 16 tokens come from the prefix cache.
    ids = chat_ids(engine, [None, "describe this picture ."])
    again = engine.generate(input_ids=ids, image_data=[a], sampling_params=GREEDY)
    image_end = prompts[0][0].index(engine.vision.rules.image_token_id) + 16
    assert again["meta_info"]["cached_tokens"] >= image_end
    assert engine.server_info()["multimodal"]["images_encoded"] == 3
    assert again["output_ids"] == gemma3_reference(gemma3, ids, [a])
    engine.check_integrity()


def test_gemma3_prefill_chunks_never_split_an_image(gemma3):
    ids_parts = ["describe", None, "and", None, "?"]
    images = [png_bytes(64, 64, 4), png_bytes(96, 64, 5)]
    # Budget 16 with each image 16 tokens long after a few text tokens: an unconstrained chunk
    # would cut both images, and the first half of an image would not see its second half.
    chunked = Engine(str(gemma3), dtype="float32", max_total_tokens=2048, chunked_prefill_size=16)
    ids = chat_ids(chunked, ids_parts)
    out = chunked.generate(input_ids=ids, image_data=images, sampling_params=GREEDY)
    assert out["output_ids"] == gemma3_reference(gemma3, ids, images)
    assert chunked.scheduler.stats["prefill_batches"] >= 3
    chunked.check_integrity()


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "gemma3"])
def test_tensor_parallel_is_refused_clearly(family, request):
    folder = request.getfixturevalue(family)
    config = ModelConfig.from_folder(folder)
    check_tensor_parallel(config, 1)
    with pytest.raises(ValueError, match=f"--tp is not supported for {config.architecture}"):
        check_tensor_parallel(config, 2)


_NO_TORCH = """
import sys
from genserve.srt.models.registry import get_processor_class
for arch in ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
             "Gemma3ForConditionalGeneration"):
    assert get_processor_class({"architectures": [arch]}) is not None, arch
assert "torch" not in sys.modules, "torch was imported"
"""


def test_processors_resolve_without_importing_torch():
    result = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "gemma3"])
def test_loads_through_the_common_path_in_the_serving_dtype(family, request):
    folder = request.getfixturevalue(family)
    model = load_model(
        ModelConfig.from_folder(folder), folder, torch.device("cpu"), torch.bfloat16, ModelKernels()
    )
    tensors = [*model.parameters(), *model.buffers()]
    assert {t.dtype for t in tensors if t.is_floating_point()} == {torch.bfloat16}
    assert not any(t.is_meta for t in tensors)


def test_gemma3_pan_and_scan_is_refused():
    from genserve.srt.multimodal.processors.gemma3 import Gemma3Processor

    config = {"image_token_index": 7, "mm_tokens_per_image": 16}
    assert Gemma3Processor.from_config(config, {}).num_tokens(None) == 16
    with pytest.raises(ValueError, match="pan-and-scan"):
        Gemma3Processor.from_config(config, {"do_pan_and_scan": True})


def test_gemma3_text_with_only_the_begin_of_image_marker_is_expanded_as_hf_does(gemma3):
    """Gemma 3's own chat template writes only the begin-of-image token for an image; the
    prompt's text is expanded as transformers' Gemma3Processor expands it (the same ids), and
    generates as the reference does."""
    import io

    import transformers as tf
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = tf.AutoTokenizer.from_pretrained(gemma3, extra_special_tokens={
        "boi_token": "<|vision_start|>", "eoi_token": "<|vision_end|>", "image_token": "<image>"})
    hf = tf.Gemma3Processor(image_processor=Gemma3ImageProcessorPil.from_pretrained(gemma3),
                            tokenizer=tok, image_seq_length=16)
    text = ("<|im_start|>user\n<|vision_start|>describe this picture .<|im_end|>\n"
            "<|im_start|>assistant\n")
    image = png_bytes(64, 64, 4)
    pil = Image.open(io.BytesIO(image)).convert("RGB")
    want = [int(t) for t in hf(text=[text], images=[[pil]])["input_ids"][0]]
    engine = Engine(str(gemma3), dtype="float32", max_total_tokens=2048)
    [ids], _ = engine._normalize(text, None)
    expanded, _ = engine.vision.process(ids, [image])
    assert expanded == want
    token = engine.vision.rules.image_token_id
    one = [t for k, t in enumerate(want) if t != token or want[k - 1] != token]
    out = engine.generate(prompt=text, image_data=image, sampling_params=GREEDY)
    assert out["output_ids"] == gemma3_reference(gemma3, one, [image])
    engine.check_integrity()
