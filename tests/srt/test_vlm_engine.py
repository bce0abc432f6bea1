"""Vision-language models through the offline Engine: greedy tokens equal to Hugging Face
transformers (several images of different sizes, batched with text-only prompts), chunked
prefill through an image, image-aware prefix caching, and nothing leaked on abort/retraction."""

from __future__ import annotations

import pytest

from genserve import Engine
from tests.srt.vlm_models import hf_reference, make_tiny_qwen2_vl, png_bytes

GREEDY = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
IMG_A = png_bytes(56, 56, 1)  # 4 tokens
IMG_B = png_bytes(112, 84, 2)  # 12 tokens
IMG_C = png_bytes(140, 70, 3)  # 10 tokens
IMG_D = png_bytes(112, 112, 4)  # 16 tokens


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm(request, tmp_path_factory):
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp(request.param), request.param)


def chat_ids(engine: Engine, parts: list) -> list[int]:
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return engine.tokenizer.encode(text)


def test_greedy_equal_to_hf_batched_with_text(vlm):
    engine = Engine(str(vlm), dtype="float32", max_total_tokens=4096)
    prompts = [
        (chat_ids(engine, [None, "what is in the image ?"]), [IMG_A]),
        (chat_ids(engine, ["compare", None, "and", None, "?"]), [IMG_B, IMG_C]),
        (chat_ids(engine, ["how many red square ?"]), None),
        (chat_ids(engine, [None, "describe this picture ."]), [IMG_D]),
        (chat_ids(engine, ["what color is a circle ?"]), None),
    ]
    outs = engine.generate(
        input_ids=[p for p, _ in prompts],
        image_data=[i for _, i in prompts],
        sampling_params=GREEDY,
    )
    engine.check_integrity()
    for (ids, images), out in zip(prompts, outs):
        assert out["output_ids"] == hf_reference(vlm, ids, images or [])
    info = engine.server_info()["multimodal"]
    assert info["images_encoded"] == 4
    assert engine.model_info()["modalities"] == ["text", "image"]


def test_chunked_prefill_through_an_image_equals_unchunked(vlm):
    whole = Engine(str(vlm), dtype="float32", max_total_tokens=4096, disable_radix_cache=True)
    ids = chat_ids(whole, ["describe", None, "and", None, "compare two images ?"])
    images = [IMG_D, IMG_B]
    ref = whole.generate(input_ids=ids, image_data=images, sampling_params=GREEDY)
    # Budget 16 with the first image at token 5: the chunks cut through both images. A zero
    # byte budget keeps only what a running prefill holds, so the chunks must keep theirs.
    chunked = Engine(
        str(vlm),
        dtype="float32",
        max_total_tokens=4096,
        chunked_prefill_size=16,
        image_cache_bytes=0,
    )
    out = chunked.generate(input_ids=ids, image_data=images, sampling_params=GREEDY)
    assert out["output_ids"] == ref["output_ids"]
    assert chunked.scheduler.stats["prefill_batches"] >= 3
    chunked.check_integrity()
    assert chunked.server_info()["multimodal"]["cached_images"] == 0  # released and evicted


def test_prefix_cache_keys_carry_the_image(vlm):
    engine = Engine(str(vlm), dtype="float32", max_total_tokens=4096)
    cold = Engine(str(vlm), dtype="float32", max_total_tokens=4096, disable_radix_cache=True)
    first = chat_ids(engine, [None, "what is the color of the shape ?"])
    second = chat_ids(engine, [None, "what is the color of the square ?"])
    image_end = first.index(engine.vision.rules.image_token_id) + 16
    a = engine.generate(input_ids=first, image_data=[IMG_D], sampling_params=GREEDY)
    # Same image, same leading text: the image's KV is shared.
    b = engine.generate(input_ids=second, image_data=[IMG_D], sampling_params=GREEDY)
    assert b["meta_info"]["cached_tokens"] > image_end
    # The scheduler found the file's hash in its embedding cache: no preprocessing, no encoding.
    assert engine.server_info()["multimodal"]["images_encoded"] == 1
    assert engine.server_info()["multimodal"]["images_preprocessed"] == 1
    # A different image (same size, same text) never matches past the image's start.
    c = engine.generate(
        input_ids=first, image_data=[png_bytes(112, 112, 99)], sampling_params=GREEDY
    )
    assert c["meta_info"]["cached_tokens"] == first.index(engine.vision.rules.image_token_id)
    assert engine.server_info()["multimodal"]["images_encoded"] == 2
    assert engine.server_info()["multimodal"]["images_preprocessed"] == 2
    for ids, img, out in (
        (first, IMG_D, a),
        (second, IMG_D, b),
        (first, png_bytes(112, 112, 99), c),
    ):
        assert (
            out["output_ids"]
            == cold.generate(input_ids=ids, image_data=[img], sampling_params=GREEDY)["output_ids"]
        )
    assert a["output_ids"] != c["output_ids"]
    engine.check_integrity()


def test_image_embeddings_are_not_shared_across_cache_salts(vlm):
    engine = Engine(str(vlm), dtype="float32", max_total_tokens=4096)
    ids = chat_ids(engine, [None, "what is in the image ?"])
    params = {**GREEDY, "max_new_tokens": 4}
    outs = [
        engine.generate(input_ids=ids, image_data=[IMG_A], sampling_params=params,
                        cache_salt=salt)
        for salt in ("tenant-a", "tenant-b", "tenant-a", None)
    ]
    info = engine.server_info()["multimodal"]
    # tenant-b and the unsalted request encode the image again (one namespace's encoded image
    # never serves another); tenant-a's second request reuses its own prefix.
    assert info["images_encoded"] == 3, info
    assert len({tuple(o["output_ids"]) for o in outs}) == 1
    engine.check_integrity()


def test_abort_and_retraction_free_kv_and_image_references(vlm):
    from genserve.srt.sampling import SamplingParams
    from genserve.srt.tokenizer_manager import make_tokenized_req

    engine = Engine(
        str(vlm),
        dtype="float32",
        max_total_tokens=160,
        max_running_requests=8,
        chunked_prefill_size=16,
    )
    sched = engine.scheduler
    params = SamplingParams.from_dict({"max_new_tokens": 40, "temperature": 0, "ignore_eos": True})
    rids, prompts = [], {}
    for i in range(6):
        ids = chat_ids(engine, [None, f"what is in the image {'?' * i}"])
        ids, mm = engine.vision.process(ids, [png_bytes(84 + 28 * (i % 2), 84, i)])
        req = make_tokenized_req(ids, params, mm_inputs=mm)
        assert sched.add_request(req) is None
        rids.append(req.rid)
        prompts[req.rid] = (chat_ids(engine, [None, f"what is in the image {'?' * i}"]),
                            png_bytes(84 + 28 * (i % 2), 84, i))
    steps = 0
    got: dict[str, list[int]] = {}
    while sched.has_work():
        for out in sched.step():
            got.setdefault(out.rid, []).extend(out.new_ids)
        steps += 1
        if steps == 3:
            sched.abort(rids[0])  # mid chunked prefill
        if steps == 12:
            sched.abort(rids[3])
    assert sched.stats["retractions"] > 0
    engine.check_integrity()
    assert sched.mm.cache.total_refs() == 0
    # Retracted requests resume with the right M-RoPE positions: same tokens as run alone.
    solo = Engine(str(vlm), dtype="float32", max_total_tokens=4096)
    for rid in (r for r in rids if r not in (rids[0], rids[3])):
        ids, image = prompts[rid]
        ref = solo.generate(input_ids=ids, image_data=[image],
                            sampling_params={"max_new_tokens": 40, "temperature": 0,
                                             "ignore_eos": True})
        assert got[rid] == ref["output_ids"]


def test_bad_image_inputs_raise_clear_errors(vlm, tiny_model_factory):
    engine = Engine(str(vlm), dtype="float32", max_total_tokens=4096, max_images_per_request=2)
    ids = chat_ids(engine, [None, "what ?"])
    with pytest.raises(ValueError, match="1 image placeholders but 2 images"):
        engine.generate(input_ids=ids, image_data=[IMG_A, IMG_B], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="at most 2"):
        engine.generate(
            input_ids=chat_ids(engine, [None, None, None]),
            image_data=[IMG_A] * 3,
            sampling_params=GREEDY,
        )
    with pytest.raises(ValueError, match="cannot be decoded"):
        engine.generate(input_ids=ids, image_data=[b"not an image"], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="1 image placeholders but no images"):
        engine.generate(input_ids=ids, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="cannot be decoded"):
        engine.generate(
            input_ids=ids, image_data=[IMG_D[: len(IMG_D) // 2]], sampling_params=GREEDY
        )
    engine.check_integrity()
    text_only = Engine(str(tiny_model_factory("qwen2")), dtype="float32", max_total_tokens=512)
    with pytest.raises(ValueError, match="does not take image inputs"):
        text_only.generate(input_ids=[5, 6, 7], image_data=[IMG_A], sampling_params=GREEDY)
