"""FLUX.2 [dev], FLUX.2 [klein] and Z-Image with their embedded tiny models: what genserve
returns equals the diffusers pipeline's own output (alone and batched, loaded from a saved
folder as a user's model is), a request's pixels are the same alone or batched, the step cache
engages through cache-dit's adapters, and the worker serves one of them end to end.

Tolerance as in test_vs_diffusers.py: within 1 uint8 level of diffusers' float output x 255.
The two rows have prompts of different lengths (Z-Image feeds each caption at its own length).
"""

from __future__ import annotations

import asyncio
import time

import diffusers
import numpy as np
import pytest
import torch

from genserve.multimodal_gen.embedded import build_embedded
from genserve.multimodal_gen.messages import (
    DiffusionRequest,
    ResolvedRequest,
    StepCacheConfig,
    StepDecision,
)
from genserve.multimodal_gen.pipelines import load_model

SIZE = 32
ROWS = (("a red cat", 1), ("a big blue dog in the city at night", 2))  # (prompt, seed)
TOLERANCE = 1.0  # uint8 levels

# name, family, guidance (FLUX.2 [dev]: the guidance embedding; [klein] base: a second
# transformer pass per step; Z-Image: negative rows batched with the positive ones)
FAMILIES = [
    ("tiny-flux2", "flux2", 4.0),
    ("tiny-flux2-klein", "flux2-klein", 4.0),
    ("tiny-z-image", "z-image", 3.0),
]


def _request(
    rid: str,
    prompt: str,
    seed: int,
    guidance: float,
    steps: int = 2,
    cache: StepCacheConfig = StepCacheConfig(),
    negative: str | None = None,
    size: int = SIZE,
) -> ResolvedRequest:
    return ResolvedRequest(
        rid,
        "m",
        prompt,
        negative,
        size,
        size,
        1,
        None,
        steps,
        guidance,
        (seed,),
        cache,
        False,
        0,
        None,
        None,
        time.time(),
    )


def _reference(pipe, rows, guidance: float, **kwargs) -> np.ndarray:
    """diffusers' float output in [0, 1], [B, 1, H, W, 3]."""
    with torch.inference_mode():
        out = pipe(
            prompt=[p for p, _ in rows],
            num_inference_steps=2,
            output_type="np",
            height=SIZE,
            width=SIZE,
            guidance_scale=guidance,
            generator=[torch.Generator().manual_seed(s) for _, s in rows],
            **kwargs,
        )
    return np.asarray(out.images)[:, None]


def _assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.uint8 and got.shape == want.shape, (got.shape, want.shape)
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64) * 255.0)
    assert diff.max() <= TOLERANCE, f"max {diff.max():.3f} levels, mean {diff.mean():.3f}"
    inside = ((got > 0) & (got < 255)).mean()  # a scale error shows where nothing is clipped
    assert inside >= 0.5, f"only {inside:.0%} of the values are unclipped"


@pytest.mark.parametrize("name, family, guidance", FAMILIES)
def test_family_equals_diffusers_alone_and_batched(name, family, guidance, tmp_path):
    pipe = build_embedded(name, shared=False)  # seed 0
    pipe.save_pretrained(tmp_path / name)
    model = load_model(str(tmp_path / name))  # genserve's path for a diffusers folder
    assert model.spec.family == family and model.spec.step_cache
    ref = diffusers.DiffusionPipeline.from_pretrained(tmp_path / name)
    ref.set_progress_bar_config(disable=True)
    assert type(ref) is type(model.pipe)
    want_alone = _reference(ref, ROWS[:1], guidance)
    want_batch = _reference(ref, ROWS, guidance)
    got_alone = model.generate([_request("a", *ROWS[0], guidance)]).frames
    got_batch = model.generate(
        [_request(f"r{i}", p, s, guidance) for i, (p, s) in enumerate(ROWS)]
    ).frames
    assert got_alone[0].shape == (1, SIZE, SIZE, 3)
    _assert_close(got_alone[0], want_alone[0])
    for i in range(len(ROWS)):
        _assert_close(got_batch[i], want_batch[i])
    assert not np.array_equal(got_batch[0], got_batch[1])  # the rows are their own


@pytest.mark.parametrize("name, family, guidance", FAMILIES)
def test_family_batches_caches_and_previews(name, family, guidance):
    model = load_model(name)
    alone = model.generate([_request("a", "a red cat", 1, guidance)])
    both = model.generate(
        [_request("b", "a big blue dog", 2, guidance), _request("a", "a red cat", 1, guidance)]
    )
    assert np.array_equal(both.frames[1], alone.frames[0])  # bit for bit
    assert not np.array_equal(both.frames[0], alone.frames[0])
    plain = model.generate([_request("p", "a red cat", 1, guidance, steps=8)])
    exact = model.generate(
        [
            _request(
                "e",
                "a red cat",
                1,
                guidance,
                steps=8,
                cache=StepCacheConfig(True, residual_diff_threshold=0.0),
            )
        ]
    )
    assert np.array_equal(exact.frames[0], plain.frames[0]) and exact.cached_steps == 0
    cached = model.generate(
        [
            _request(
                "c",
                "a red cat",
                1,
                guidance,
                steps=8,
                # Random weights move the front blocks' residual a lot from step to step.
                cache=StepCacheConfig(True, residual_diff_threshold=1.0, warmup_steps=2),
            )
        ]
    )
    assert 0 < cached.cached_steps <= 6
    assert not np.array_equal(cached.frames[0], plain.frames[0])
    again = model.generate([_request("p", "a red cat", 1, guidance, steps=8)])
    assert np.array_equal(again.frames[0], plain.frames[0]) and again.cached_steps == 0
    # The last step's latents, as the step hook gets them, decode to the output's pixels.
    last = {}

    def on_step(step: int, total: int, tensors: dict) -> StepDecision:
        if step == total:
            last["preview"] = model.preview(tensors, plain_req, full_decode=True)
        return StepDecision.CONTINUE

    plain_req = _request("p", "a red cat", 1, guidance, steps=8)
    hooked = model.generate([plain_req], on_step)
    assert np.array_equal(hooked.frames[0], plain.frames[0])
    diff = np.abs(last["preview"].astype(int) - hooked.frames[0].astype(int))
    assert diff.max() <= 1
    # [1, C, 1, h, w]: FLUX.2's 2x2-patchified latents, Z-Image's at 1/8 resolution
    shape = (1, 16, 1, SIZE // 16, SIZE // 16) if family.startswith("flux2") else (1, 4, 1, 4, 4)
    latents = torch.zeros(shape)
    preview = model.preview(
        {"latents": latents}, _request("a", "x", 1, guidance), full_decode=False
    )
    assert preview.shape == (1, SIZE, SIZE, 3)


def test_z_image_negative_prompt_and_no_guidance():
    """Z-Image guides from any guidance above 0 against the request's negative prompt (an empty
    one by default); at guidance 0 (Turbo) the negative prompt plays no part."""
    model = load_model("tiny-z-image")

    def run(guidance, negative=None):
        req = _request("n", "a red cat", 1, guidance, negative=negative)
        return model.generate([req]).frames[0]

    assert not np.array_equal(run(3.0, "a dark night"), run(3.0))
    assert np.array_equal(run(0.0, "a dark night"), run(0.0))
    assert not np.array_equal(run(0.0), run(3.0))


def test_z_image_image_to_image_equals_diffusers():
    """Image-to-image runs `ZImageImg2ImgPipeline` on the model's components: the pixels are
    that pipeline's, and another input picture gives another output."""
    import dataclasses
    import io

    from PIL import Image

    model = load_model("tiny-z-image")
    assert model.spec.supports_image_to_image
    ref = diffusers.ZImageImg2ImgPipeline(**build_embedded("tiny-z-image", shared=False).components)
    ref.set_progress_bar_config(disable=True)

    def run(color):
        image = Image.new("RGB", (SIZE, SIZE), color)
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        req = _request("i", "a red cat", 1, 2.0, steps=4)
        got = model.generate([dataclasses.replace(req, init_image=buf.getvalue(), strength=0.5)])
        with torch.inference_mode():
            want = ref(
                prompt=["a red cat"],
                image=[image],
                strength=0.5,
                num_inference_steps=4,
                guidance_scale=2.0,
                height=SIZE,
                width=SIZE,
                output_type="np",
                generator=[torch.Generator().manual_seed(1)],
            ).images
        _assert_close(got.frames[0], np.asarray(want))
        assert got.total_steps == 2  # only the re-noised half of the schedule runs
        return got.frames[0]

    assert not np.array_equal(run((255, 0, 0)), run((0, 0, 255)))


def test_worker_serves_z_image_like_diffusers():
    """End to end through the worker process (batcher, resolve, events): the pixels of two
    outputs of one request are diffusers' for the same seeds."""
    from genserve.multimodal_gen.engine_client import WorkerDiffusionClient
    from genserve.multimodal_gen.messages import ResultEvent
    from genserve.multimodal_gen.worker import WorkerConfig

    async def main():
        client = WorkerDiffusionClient(WorkerConfig(("tiny-z-image",), num_threads=1))
        try:
            req = DiffusionRequest(
                "w",
                "tiny-z-image",
                "a red cat",
                width=SIZE,
                height=SIZE,
                num_inference_steps=2,
                guidance_scale=3.0,
                seed=7,
                num_outputs=2,
            )
            return [event async for event in client.stream(req)]
        finally:
            await client.shutdown()

    events = asyncio.run(main())
    result = events[-1]
    assert isinstance(result, ResultEvent) and result.seeds == [7, 8]
    ref = build_embedded("tiny-z-image", shared=False)
    ref.set_progress_bar_config(disable=True)
    want = _reference(ref, (("a red cat", 7), ("a red cat", 8)), 3.0)
    for i in range(2):
        _assert_close(result.outputs[i], want[i])


def test_klein_final_latents_come_back_exactly_in_bf16():
    """Klein returns VAE-ready latents; genserve normalizes them back for its decode, which must
    recover the pipeline's bf16 values bit for bit (a bf16 round trip would move them)."""
    from genserve.multimodal_gen.pipelines import LoadOptions
    from genserve.multimodal_gen.pipelines.flux2 import _bn_statistics

    model = load_model("tiny-flux2-klein", LoadOptions(dtype="bfloat16"))
    final = (torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    z = model.unpack_latents(final, _request("k", "x", 1, 1.0))[:, :, 0]
    mean, std = _bn_statistics(model.pipe.vae, z)
    back = model.pipe._unpatchify_latents(z * std + mean).to(torch.bfloat16)
    assert torch.equal(back, final)


def _picture(seed: int, side: int = 64) -> bytes:
    import io

    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("name, family, guidance", FAMILIES[:2])
def test_flux2_edits_from_reference_images_as_diffusers_does(name, family, guidance):
    """FLUX.2's pipeline edits from reference images (its `image` argument): two references
    (at their own 64 px size: the pipeline sizes them itself), two rows batched on them, equal
    to diffusers given the same pictures."""
    import dataclasses
    import io

    from PIL import Image

    model = load_model(name)
    assert model.spec.task == "text-to-image" and model.spec.max_reference_images > 1
    refs = (_picture(1), _picture(2))
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in refs]
    want = _reference(model.pipe, ROWS, guidance, image=pictures)
    rows = [dataclasses.replace(_request(f"r{i}", p, s, guidance), reference_images=refs,
                                condition_digest="two-references")
            for i, (p, s) in enumerate(ROWS)]
    got = model.generate(rows).frames
    for i in range(len(ROWS)):
        _assert_close(got[i], want[i])
    plain = model.generate([_request("p", *ROWS[0], guidance)]).frames[0]
    assert not np.array_equal(plain, got[0])  # the references shape the picture
