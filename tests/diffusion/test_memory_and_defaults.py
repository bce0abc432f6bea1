"""Memory options on CPU (VAE tiling and slicing, int8 weight-only quantization of the
denoiser, offload as a no-op without an accelerator) and per-checkpoint defaults read from the
checkpoint's own config (FLUX.1 [schnell], SDXL-Turbo), shown in the model card."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from genserve.multimodal_gen.embedded import build_embedded
from genserve.multimodal_gen.messages import ResolvedRequest, StepCacheConfig
from genserve.multimodal_gen.pipelines import LoadOptions, MemoryOptions, load_model
from tests.diffusion.test_vs_diffusers import _assert_close, _reference


def req(size=32, seeds=(1, 2), steps=2) -> ResolvedRequest:
    return ResolvedRequest("r", "m", "a red cat", None, size, size, 1, None, steps, 3.5,
                           tuple(seeds), StepCacheConfig(), False, 0, None, None, time.time())


def frames(model, r) -> list[np.ndarray]:
    return model.generate([r]).frames


def test_options_are_checked():
    with pytest.raises(ValueError, match="offload must be one of"):
        MemoryOptions(offload="disk")
    with pytest.raises(ValueError, match="quantization must be one of"):
        MemoryOptions(quantization="int4")
    assert LoadOptions(cpu_offload=True).memory.offload == "model"  # the older flag


def test_vae_tiling_and_slicing_decode_as_diffusers_does():
    r = req(size=128, seeds=(1,))
    tiled = load_model("tiny-flux", LoadOptions(memory=MemoryOptions(vae_tiling=True)))
    assert tiled.pipe.vae.use_tiling and tiled.pipe is not load_model("tiny-flux").pipe
    got = frames(tiled, r)[0]
    ref = build_embedded("tiny-flux", shared=False)  # seed 0
    ref.set_progress_bar_config(disable=True)
    ref.vae.enable_tiling()
    want = _reference(ref, (("a red cat", 1),), height=128, width=128, guidance_scale=3.5)
    _assert_close(got, want[0], 255.0)  # genserve's decode takes diffusers' tiled path
    # 128 px is over the tiny VAE's 32 px tile: the tiles (blended at the seams) do change it.
    plain = frames(load_model("tiny-flux"), r)[0]
    assert not np.array_equal(got, plain)
    sliced = load_model("tiny-flux", LoadOptions(memory=MemoryOptions(vae_slicing=True)))
    assert sliced.pipe.vae.use_slicing
    assert np.array_equal(frames(sliced, r)[0], plain)  # one picture per decode already


def test_int8_weight_only_quantization_of_the_denoiser():
    plain = load_model("tiny-flux")
    quant = load_model("tiny-flux", LoadOptions(memory=MemoryOptions(quantization="int8wo")))
    linears = [m for m in quant.denoiser.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m.weight).__name__ != "Parameter" for m in linears)
    assert all(type(m.weight).__name__ == "Parameter" for m in plain.denoiser.modules()
               if isinstance(m, torch.nn.Linear))  # the shared instance is untouched
    r = req()
    want = [f.astype(np.int16) for f in frames(plain, r)]
    got = [f.astype(np.int16) for f in frames(quant, r)]
    for g, w in zip(got, want, strict=True):
        assert np.abs(g - w).mean() < 4.0  # int8 weights: close to, not equal to, float32
    # Batch invariance holds on the quantized denoiser too.
    alone = frames(quant, req(seeds=(2,)))[0]
    assert np.array_equal(alone, frames(quant, r)[1])


def test_offload_without_an_accelerator_keeps_the_weights_in_place():
    model = load_model("tiny-flux", LoadOptions(memory=MemoryOptions(offload="sequential")))
    assert model.device.type == "cpu"
    assert frames(model, req(seeds=(1,)))[0].shape == (1, 32, 32, 3)


def test_distilled_checkpoints_bring_their_defaults(tmp_path):
    from diffusers import EulerAncestralDiscreteScheduler

    flux = build_embedded("tiny-flux", shared=False)  # no guidance embedding: [schnell]-like
    sdxl = build_embedded("tiny-sdxl", shared=False)
    flux.save_pretrained(tmp_path / "schnell")
    card = load_model(str(tmp_path / "schnell")).spec.to_model_card()
    assert (card["default_steps"], card["default_guidance"]) == (4, 0.0)
    assert card["scheduler"]["class"] == "FlowMatchEulerDiscreteScheduler"
    sdxl.save_pretrained(tmp_path / "sdxl")
    base = load_model(str(tmp_path / "sdxl")).spec
    assert (base.default_steps, base.default_guidance) == (30, 5.0)
    sdxl.scheduler = EulerAncestralDiscreteScheduler.from_config(
        sdxl.scheduler.config, timestep_spacing="trailing")
    sdxl.save_pretrained(tmp_path / "turbo")
    turbo = load_model(str(tmp_path / "turbo")).spec.to_model_card()
    assert (turbo["default_steps"], turbo["default_guidance"]) == (4, 0.0)
    assert turbo["scheduler"]["timestep_spacing"] == "trailing"
