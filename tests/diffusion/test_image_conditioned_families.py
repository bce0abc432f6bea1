"""The families added for SDXL, Qwen-Image, FLUX.1 Kontext / Fill and Wan image-to-video, with
their embedded tiny models in this process: a request's pixels are the same alone or batched,
the reference image (and mask) change the output, the step cache engages where cache-dit
supports the denoiser, and previews come out at the output size."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
import torch
from PIL import Image

from genserve.multimodal_gen.messages import ResolvedRequest, StepCacheConfig
from genserve.multimodal_gen.pipelines import load_model

SIZE = 32


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _picture(seed: int) -> bytes:
    return _png(np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))


MASK = np.zeros((SIZE, SIZE), dtype=np.uint8)
MASK[:, SIZE // 2:] = 255


def req(rid, seed, prompt, frames, guidance, steps=2, cache=StepCacheConfig(), images=(),
        mask=None) -> ResolvedRequest:
    return ResolvedRequest(rid, "m", prompt, None, SIZE, SIZE, frames, None, steps, guidance,
                           (seed,), cache, False, 0, None, None, time.time(),
                           reference_images=tuple(images), mask_image=mask,
                           condition_digest=str(hash((tuple(images), mask))) if images else "")


# name, frames, guidance, step cache supported, needs an image, needs a mask
FAMILIES = [
    ("tiny-sdxl", 1, 4.0, False, False, False),
    ("tiny-qwen-image", 1, 2.5, True, False, False),
    ("tiny-flux-kontext", 1, 2.5, True, True, False),
    ("tiny-flux-fill", 1, 10.0, True, True, True),
    ("tiny-wan-i2v", 5, 2.0, True, True, False),
]


@pytest.mark.parametrize("name, frames, guidance, caches, image, mask", FAMILIES)
def test_family_batches_conditions_caches_and_previews(name, frames, guidance, caches, image,
                                                       mask):
    model = load_model(name)
    assert model.spec.step_cache == caches
    cond = {}
    if image:
        cond["images"] = (_picture(1),)
    if mask:
        cond["mask"] = _png(MASK)

    def run(*requests):
        return model.generate(list(requests))

    alone = run(req("a", 1, "a red cat", frames, guidance, **cond))
    assert alone.frames[0].shape == (frames, SIZE, SIZE, 3)
    both = run(req("b", 2, "a blue dog", frames, guidance, **cond),
               req("a", 1, "a red cat", frames, guidance, **cond))
    assert np.array_equal(both.frames[1], alone.frames[0])
    assert not np.array_equal(both.frames[0], alone.frames[0])
    if image:  # another reference image, another output
        other = dict(cond, images=(_picture(2),))
        moved = run(req("c", 1, "a red cat", frames, guidance, **other))
        assert not np.array_equal(moved.frames[0], alone.frames[0])
    if mask:  # another mask, another output
        moved = run(req("d", 1, "a red cat", frames, guidance,
                        **dict(cond, mask=_png(255 - MASK))))
        assert not np.array_equal(moved.frames[0], alone.frames[0])
    cached = run(req("e", 1, "a red cat", frames, guidance, steps=8,
                     cache=StepCacheConfig(True, residual_diff_threshold=0.5), **cond))
    assert (cached.cached_steps > 0) == caches
    latents = torch.zeros(1, 4, 1, SIZE // 8, SIZE // 8)
    preview = model.preview({"latents": latents}, req("a", 1, "x", frames, guidance),
                            full_decode=False)
    assert preview.shape == (frames, SIZE, SIZE, 3)


def test_sdxl_micro_conditioning_follows_the_size():
    """SDXL's UNet is told the picture's size: the same seed at another aspect ratio is not a
    crop or stretch of the square one (the added time ids differ)."""
    model = load_model("tiny-sdxl")
    seen = []
    hook = model.pipe.unet.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["added_cond_kwargs"]["time_ids"][0].tolist()),
        with_kwargs=True)
    try:
        for w, h in ((32, 32), (48, 32)):
            r = ResolvedRequest("s", "m", "a red cat", None, w, h, 1, None, 1, 1.0, (1,),
                                StepCacheConfig(), False, 0, None, None, time.time())
            model.generate([r])
    finally:
        hook.remove()
    assert seen[0] == [32, 32, 0, 0, 32, 32] and seen[-1] == [32, 48, 0, 0, 32, 48]
