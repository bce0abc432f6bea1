"""The video families added in 2026 (Wan 2.2 TI2V-5B and A14B, HunyuanVideo 1.5) with their
embedded tiny models: each equals diffusers' own output alone and batched (as in
test_vs_diffusers.py: the same folder loaded by genserve and by diffusers, within 1 uint8
level), and the step cache engages where cache-dit supports the transformer. Wan 2.2 A14B's
second expert runs its share of the steps and is batch invariant, quantized and step-cached
like the first."""

from __future__ import annotations

import dataclasses
import time

import diffusers
import numpy as np
import pytest
import torch

from genserve.multimodal_gen.embedded import build_embedded
from genserve.multimodal_gen.messages import ResolvedRequest, StepCacheConfig, StepDecision
from genserve.multimodal_gen.pipelines import LoadOptions, load_model
from genserve.multimodal_gen.pipelines.memory import MemoryOptions
from tests.diffusion.test_vs_diffusers import ROWS, _assert_close, _product, _reference

CACHE = StepCacheConfig(True, residual_diff_threshold=0.5)


def _odd_latent_statistics(pipe) -> None:
    """Latent normalisation that is not the identity, saved with the folder."""
    vae = pipe.vae
    if isinstance(getattr(vae, "latents_mean", None), torch.Tensor):  # LTX-2: buffers
        with torch.no_grad():
            vae.latents_mean.copy_(torch.linspace(-0.3, 0.4, vae.latents_mean.numel()))
            vae.latents_std.copy_(torch.linspace(0.5, 2.0, vae.latents_std.numel()))
        vae.register_to_config(scaling_factor=0.7)
        return
    if not hasattr(vae.config, "latents_mean"):
        return  # HunyuanVideo 1.5: a scaling factor only (0.7 in the tiny model)
    c = vae.config.z_dim
    vae.register_to_config(
        latents_mean=np.linspace(-0.3, 0.4, c).tolist(),
        latents_std=np.linspace(0.5, 2.0, c).tolist(),
    )


# name, size, frames, guidance (> 1 runs classifier-free guidance)
FAMILIES = [
    ("tiny-wan22-ti2v", 64, 5, 2.0),
    ("tiny-wan22-a14b", 32, 5, 2.0),
    ("tiny-hunyuan-video15", 32, 5, 2.5),
    ("tiny-ltx2", 32, 9, 3.0),
]


@pytest.mark.parametrize("name, size, frames, guidance", FAMILIES)
def test_family_equals_diffusers_alone_and_batched(name, size, frames, guidance, tmp_path):
    pipe = build_embedded(name, shared=False)  # seed 0
    _odd_latent_statistics(pipe)
    pipe.save_pretrained(tmp_path / name)
    model = load_model(str(tmp_path / name))
    ref = diffusers.DiffusionPipeline.from_pretrained(tmp_path / name)
    ref.set_progress_bar_config(disable=True)
    kwargs = dict(height=size, width=size, num_frames=frames, guidance_scale=guidance)
    if name == "tiny-hunyuan-video15":  # guidance is the pipeline's guider component
        ref.guider = ref.guider.new(guidance_scale=kwargs.pop("guidance_scale"))
    if name == "tiny-ltx2":
        # What genserve passes: a request's fps (24 when it names none); no spatio-temporal
        # guidance, whose block 28 a 2-layer transformer lacks.
        kwargs.update(
            frame_rate=24, spatio_temporal_guidance_blocks=None, stg_scale=0.0, audio_stg_scale=0.0
        )
    # Each row of genserve's batch equals diffusers running that request alone.
    want = [_reference(ref, [row], **kwargs)[0] for row in ROWS]
    got_alone = _product(model, ROWS[:1], size, frames, guidance)
    got_batch = _product(model, ROWS, size, frames, guidance)
    assert got_alone[0].shape == (frames, size, size, 3)
    _assert_close(got_alone[0], want[0], 255.0)
    for i in range(len(ROWS)):
        _assert_close(got_batch[i], want[i], 255.0)
    assert not np.array_equal(got_batch[0], got_batch[1])
    if name != "tiny-hunyuan-video15":
        # ... and diffusers' own batch (its HunyuanVideo 1.5 VAE cannot decode two videos at
        # once: the causal attention mask of its mid block has the wrong rank for a batch).
        want_batch = _reference(ref, ROWS, **kwargs)
        for i in range(len(ROWS)):
            _assert_close(got_batch[i], want_batch[i], 255.0)


def _request(steps: int, cache: StepCacheConfig = StepCacheConfig(), size: int = 32):
    return ResolvedRequest(
        "r",
        "m",
        "a red cat",
        None,
        size,
        size,
        5,
        None,
        steps,
        2.0,
        (1,),
        cache,
        False,
        0,
        None,
        None,
        time.time(),
    )


def _steps(model, steps: int, cache: StepCacheConfig = StepCacheConfig(), size: int = 32):
    return model.generate([_request(steps, cache, size)])


def test_wan22_checkpoint_defaults():
    ti2v = load_model("tiny-wan22-ti2v")
    # The 2.2 VAE's 16x and the 2x2 transformer patch: sizes are multiples of 32.
    assert ti2v.spec.size_factor == 32 and ti2v.spec.family == "wan"
    # 8 latent channels at 1/16 of 64 px; the cheap projection is fitted to the 2.2 VAE.
    preview = ti2v.preview({"latents": torch.zeros(1, 8, 2, 4, 4)}, _request(2, size=64), False)
    assert preview.shape == (5, 64, 64, 3)
    a14b = load_model("tiny-wan22-a14b")
    assert a14b.spec.size_factor == 16 and len(a14b.denoisers) == 2


def test_wan22_experts_split_the_steps_and_cache_each():
    model = load_model("tiny-wan22-a14b")
    high, low = model.denoisers
    assert high is model.pipe.transformer and low is model.pipe.transformer_2
    # Shift 3 on 8 steps: timesteps >= 875 go to the high-noise expert.
    assert model.expert_steps(8) == (3, 5)
    calls = {"high": 0, "low": 0}
    hooks = [
        m.register_forward_pre_hook(lambda *_, k=k: calls.__setitem__(k, calls[k] + 1))
        for k, m in (("high", high), ("low", low))
    ]
    try:
        plain = _steps(model, 8)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == {"high": 3 * 2, "low": 5 * 2}  # classifier-free guidance: 2 calls a step
    # Both experts are batch invariant (their linear layers wrapped) and step-cached.
    for expert in (high, low):
        linear = next(m for m in expert.modules() if isinstance(m, torch.nn.Linear))
        assert "forward" in vars(linear)
    exact = _steps(model, 8, StepCacheConfig(True, residual_diff_threshold=0.0))
    assert exact.cached_steps == 0 and np.array_equal(exact.frames[0], plain.frames[0])
    cached = _steps(model, 8, CACHE)
    assert 0 < cached.cached_steps < 8
    assert "forward" in vars(high) and "forward" in vars(low)  # each its own cache-dit hook
    again = _steps(model, 8)
    assert again.cached_steps == 0 and np.array_equal(again.frames[0], plain.frames[0])


def test_wan22_quantization_covers_both_experts():
    model = load_model("tiny-wan22-a14b", LoadOptions(memory=MemoryOptions(quantization="int8wo")))
    for expert in model.denoisers:
        linears = [m for m in expert.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(type(m.weight).__name__ != "Parameter" for m in linears)
    assert _steps(model, 2).frames[0].shape == (5, 32, 32, 3)


def test_context_parallelism_takes_both_experts_and_refuses_hunyuan_video15():
    from genserve.multimodal_gen.context_parallel import check_supported

    a14b = load_model("tiny-wan22-a14b")
    check_supported(a14b, 2)  # both experts split (tests/diffusion/test_context_parallel.py)
    assert all(n > 0 for n in a14b.expert_steps(4))  # that test's four steps use both
    check_supported(load_model("tiny-wan22-ti2v"), 2)
    check_supported(load_model("tiny-ltx2"), 2)
    with pytest.raises(ValueError, match="hunyuan-video-1.5\\) cannot be split"):
        check_supported(load_model("tiny-hunyuan-video15"), 2)


def test_hunyuan_video15_reports_steps_caches_and_restores_its_guider():
    model = load_model("tiny-hunyuan-video15")
    assert model.spec.step_cache and model.spec.size_factor == 16
    scale = model.pipe.guider.guidance_scale
    seen = []

    def on_step(step, total, tensors):
        seen.append((step, total, tuple(tensors["latents"].shape) if tensors else None))
        return StepDecision.CONTINUE

    plain = model.generate([_request(4)], on_step)
    # Step 0 before the loop, then one report per step with that step's latents.
    assert seen == [(0, 4, None)] + [(i, 4, (1, 4, 2, 2, 2)) for i in (1, 2, 3, 4)]
    assert model.pipe.guider.guidance_scale == scale  # the request's scale was for its call
    assert "step" not in vars(model.pipe.scheduler)
    stopped = model.generate(
        [_request(4)],
        lambda step, total, t: StepDecision.CANCEL if step == 1 else StepDecision.CONTINUE,
    )
    assert stopped.decision is StepDecision.CANCEL and stopped.frames == []
    exact = model.generate([_request(8, StepCacheConfig(True, residual_diff_threshold=0.0))])
    assert exact.cached_steps == 0
    cached = model.generate([_request(8, CACHE)])
    assert 0 < cached.cached_steps < 8
    again = model.generate([_request(4)])
    assert np.array_equal(again.frames[0], plain.frames[0])
    for full in (False, True):
        preview = model.preview({"latents": torch.zeros(1, 4, 2, 2, 2)}, _request(4), full)
        assert preview.shape == (5, 32, 32, 3) and preview.dtype == np.uint8


def test_ltx2_video_steps_previews_and_no_step_cache():
    model = load_model("tiny-ltx2")
    assert model.spec.size_factor == 8 and model.spec.frame_rule == "8k+1"
    seen = []

    def on_step(step, total, tensors):
        if tensors:  # a step's packed latents, unpacked and denormalized like the result
            seen.append(tuple(tensors["latents"].shape))
        return StepDecision.CONTINUE

    req = ResolvedRequest(
        "r",
        "m",
        "a red cat",
        None,
        32,
        32,
        9,
        None,
        2,
        3.0,
        (1,),
        StepCacheConfig(),
        False,
        0,
        None,
        None,
        time.time(),
    )
    plain = model.generate([req], on_step)
    assert seen == [(1, 4, 2, 4, 4)] * 2 and plain.frames[0].shape == (9, 32, 32, 3)
    preview = model.preview({"latents": torch.zeros(1, 4, 2, 4, 4)}, req, False)
    assert preview.shape == (9, 32, 32, 3)
    cached = model.generate([dataclasses.replace(req, num_inference_steps=8, step_cache=CACHE)])
    # No step cache for LTX-2 (cache-dit's adapter does not take its transformer's
    # arguments): the model says so, and a request asking for it runs uncached.
    assert not model.spec.step_cache and cached.cached_steps == 0
