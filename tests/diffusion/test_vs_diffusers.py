"""Each served diffusion family against the pipeline's own output: what genserve returns for a
request equals what the diffusers pipeline (`output_type="np"`, the same per-row generators and
steps) returns, alone and batched.

genserve takes the pipeline's latents and does its own unpacking, latent scaling / shift /
normalisation, VAE decode and uint8 conversion per family (`pipelines/*.py`); this is the test
that fails when one of those steps is wrong. The reference is a second pipeline instance that
diffusers loads from the same folder, untouched by genserve (no batch-invariant layers, no
channels-last VAE, no kept position tables). The tiny Wan and LTX VAEs get non-trivial latent
mean / std / scaling so that applying them the wrong way round cannot go unnoticed.

The image-conditioned families (Kontext, Fill, Wan image-to-video) get the same reference image
(and mask) on both sides; a batch shares one set, as genserve batches only requests with the
same images.

Tolerance: genserve's uint8 value is within 1 level of diffusers' float output times 255 (a
rounding step plus float noise from a different summation order); a wrong factor moves most
values by many levels.
"""

from __future__ import annotations

import io
import time

import diffusers
import numpy as np
import pytest
import torch

from genserve.demo_models.models import weights_path
from genserve.demo_models.pipeline import ShapesImagePipeline, ShapesVideoPipeline
from genserve.multimodal_gen.embedded import build_embedded
from genserve.multimodal_gen.messages import ResolvedRequest, StepCacheConfig
from genserve.multimodal_gen.pipelines import load_model

ROWS = (("a red cat", 1), ("a blue dog", 2))  # (prompt, seed)
TOLERANCE = 1.0  # uint8 levels, at every value


def _odd_latent_statistics(name: str, pipe) -> None:
    """Latent normalisation that is not the identity, saved with the folder."""
    vae = pipe.vae
    if name in ("tiny-wan", "tiny-wan-i2v", "tiny-qwen-image", "tiny-sdxl"):
        vae.register_to_config(latents_mean=[0.3, -0.2, 0.1, 0.5],
                               latents_std=[2.0, 0.5, 1.5, 0.8])
    elif name == "tiny-ltx":
        with torch.no_grad():
            vae.latents_mean.copy_(torch.linspace(-0.3, 0.4, vae.latents_mean.numel()))
            vae.latents_std.copy_(torch.linspace(0.5, 2.0, vae.latents_std.numel()))
        vae.register_to_config(scaling_factor=0.7)


# name, size, frames, guidance (> 1 runs classifier-free guidance where the family has it)
FAMILIES = [
    ("tiny-flux", 32, 1, 3.5),
    ("tiny-sd3", 32, 1, 4.0),
    ("tiny-sd", 32, 1, 4.0),
    ("tiny-wan", 32, 5, 2.0),
    ("tiny-ltx", 64, 9, 3.0),
    ("tiny-sdxl", 32, 1, 4.0),
    ("tiny-qwen-image", 32, 1, 2.5),
    ("tiny-flux-kontext", 32, 1, 2.5),
    ("tiny-flux-fill", 32, 1, 10.0),
    ("tiny-wan-i2v", 32, 5, 2.0),
]


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _conditions(name: str, size: int, rows: int) -> tuple[dict, dict]:
    """(diffusers kwargs, genserve request fields) of an image-conditioned family: a seeded
    noise picture, and for inpainting a mask whose right half is white (repaint)."""
    from PIL import Image

    rng = np.random.default_rng(3)
    image = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    mask = np.zeros((size, size), dtype=np.uint8)
    mask[:, size // 2:] = 255
    if name == "tiny-flux-kontext":
        # genserve keeps the requested size (the pipeline would rescale to 1024x1024).
        ref = dict(image=image, max_area=size * size, _auto_resize=False)
    elif name == "tiny-flux-fill":
        # One per row, as genserve passes them: the masked image's latents are sampled with
        # each row's own generator.
        ref = dict(image=[image] * rows, mask_image=[Image.fromarray(mask)] * rows)
    elif name == "tiny-wan-i2v":
        ref = dict(image=image)
    else:
        return {}, {}
    fields = dict(reference_images=(_png(image),), condition_digest="same")
    if "mask_image" in ref:
        fields["mask_image"] = _png(Image.fromarray(mask))
    return ref, fields


def _request(rid: str, prompt: str, seed: int, size: int, frames: int, guidance: float,
             steps: int = 2, **fields) -> ResolvedRequest:
    return ResolvedRequest(rid, "m", prompt, None, size, size, frames, None, steps, guidance,
                           (seed,), StepCacheConfig(), False, 0, None, None, time.time(),
                           **fields)


def _product(model, rows, size, frames, guidance, **fields) -> list[np.ndarray]:
    batch = [_request(f"r{i}", p, s, size, frames, guidance, **fields)
             for i, (p, s) in enumerate(rows)]
    return model.generate(batch).frames  # per row uint8 [F, H, W, 3]


def _reference(pipe, rows, **kwargs) -> np.ndarray:
    """diffusers' float output in [0, 1], [B, F, H, W, 3]."""
    with torch.inference_mode():
        out = pipe(prompt=[p for p, _ in rows], num_inference_steps=2, output_type="np",
                   generator=[torch.Generator().manual_seed(s) for _, s in rows], **kwargs)
    images = np.asarray(out.images if hasattr(out, "images") else out.frames)
    return images[:, None] if images.ndim == 4 else images  # images get a frame axis


def _assert_close(got: np.ndarray, want: np.ndarray, scale: float,
                  min_unclipped: float = 0.5) -> None:
    assert got.dtype == np.uint8 and got.shape == want.shape, (got.shape, want.shape)
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64) * scale)
    assert diff.max() <= TOLERANCE, f"max {diff.max():.3f} levels, mean {diff.mean():.3f}"
    # A scale error shows only where the picture is not clipped flat.
    inside = ((got > 0) & (got < 255)).mean()
    assert inside >= min_unclipped, f"only {inside:.0%} of the values are unclipped"


@pytest.mark.parametrize("name, size, frames, guidance", FAMILIES)
def test_family_equals_diffusers_alone_and_batched(name, size, frames, guidance, tmp_path):
    pipe = build_embedded(name, shared=False)  # seed 0
    _odd_latent_statistics(name, pipe)
    pipe.save_pretrained(tmp_path / name)
    model = load_model(str(tmp_path / name))  # genserve's path for a diffusers folder
    ref = diffusers.DiffusionPipeline.from_pretrained(tmp_path / name)
    ref.set_progress_bar_config(disable=True)
    kwargs = dict(height=size, width=size, guidance_scale=guidance)
    if frames > 1:
        kwargs["num_frames"] = frames
    if name == "tiny-ltx":
        kwargs["frame_rate"] = 24  # what genserve passes when a request names no fps
    if name == "tiny-qwen-image":
        # Qwen-Image guides with a negative prompt; genserve's is " " when a request has none.
        kwargs = dict(height=size, width=size, true_cfg_scale=guidance, negative_prompt=" ")
    want_alone = _reference(ref, ROWS[:1], **kwargs, **_conditions(name, size, 1)[0])
    condition, fields = _conditions(name, size, len(ROWS))
    want_batch = _reference(ref, ROWS, **kwargs, **condition)
    got_alone = _product(model, ROWS[:1], size, frames, guidance, **fields)
    got_batch = _product(model, ROWS, size, frames, guidance, **fields)
    assert got_alone[0].shape == (frames, size, size, 3)
    _assert_close(got_alone[0], want_alone[0], 255.0)
    for i in range(len(ROWS)):
        _assert_close(got_batch[i], want_batch[i], 255.0)
    assert not np.array_equal(got_batch[0], got_batch[1])  # the rows are their own


@pytest.mark.parametrize("kind, pipeline_cls, guidance, prompts", [
    ("image", ShapesImagePipeline, 1.5, ("a red circle on a gray background, top left",
                                         "a blue square on a white background, center")),
    ("video", ShapesVideoPipeline, 3.0, ("a blue square moving right on a gray background",
                                         "a green triangle moving up on a black background")),
])
def test_demo_model_equals_its_pipeline(kind, pipeline_cls, guidance, prompts):
    """The demo models are genserve's own diffusers pipeline class; served through the family
    adapter (latents, upscale, uint8) they give what the pipeline's `output_type="np"` gives."""
    model = load_model(f"shapes-{kind}")
    ref = pipeline_cls.from_pretrained(weights_path(kind), torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    rows = tuple(zip(prompts, (1, 2), strict=True))
    frames = model.spec.default_num_frames or 1
    want = _reference(ref, rows, height=64, width=64, guidance_scale=guidance)
    got = _product(model, rows, 64, frames, guidance)
    for i in range(len(rows)):
        # The reference is uint8 already; the trained models draw saturated colours.
        _assert_close(got[i], want[i], 1.0, min_unclipped=0.0)


def test_http_image_equals_diffusers(http):
    """End to end: the PNG the server returns (worker process, batcher, encoder) holds diffusers'
    pixels for the embedded tiny-flux (built from the same seeded weights)."""
    import base64
    import io

    from PIL import Image

    body = {"model": "tiny-flux", "prompt": "a red cat", "size": "32x32", "seed": 7, "n": 2,
            "num_inference_steps": 2, "guidance_scale": 3.5, "response_format": "b64_json"}
    r = http.post("/v1/images/generations", json=body)
    assert r.status_code == 200, r.text
    got = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))).convert("RGB"))
           for d in r.json()["data"]]
    ref = build_embedded("tiny-flux", shared=False)  # seed 0
    ref.set_progress_bar_config(disable=True)
    want = _reference(ref, (("a red cat", 7), ("a red cat", 8)), height=32, width=32,
                      guidance_scale=3.5)
    for i in range(2):
        _assert_close(got[i][None], want[i], 255.0)
