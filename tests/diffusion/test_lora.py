"""LoRA adapters: loaded at start by name, applied per request with a scale, equal to diffusers'
own `load_lora_weights` + `set_adapters` output, batched only with the same adapters; a request
naming an unknown adapter and an adapter that fits no layer of the model are clear errors."""

from __future__ import annotations

import time

import diffusers
import numpy as np
import pytest
import torch

from genserve.multimodal_gen.embedded import build_embedded
from genserve.multimodal_gen.messages import (
    DiffusionRequest,
    ModelSpec,
    ResolvedRequest,
    StepCacheConfig,
)
from genserve.multimodal_gen.pipelines import LoadOptions, load_model
from genserve.multimodal_gen.validation import resolve_request
from tests.diffusion.test_vs_diffusers import _assert_close, _reference

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def _seeded(name: str):
    return build_embedded(name, shared=False)


def make_lora(pipe, path, seed: int, targets=TARGETS) -> str:
    """A rank-4 adapter with random (non-zero) weights on the denoiser's attention
    projections, saved in diffusers' LoRA format."""
    from peft import LoraConfig  # here, not at collection: slow to import
    from peft.utils import get_peft_model_state_dict

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets,
                                                init_lora_weights=False), adapter_name="new")
    layers = get_peft_model_state_dict(pipe.transformer, adapter_name="new")
    type(pipe).save_lora_weights(path, transformer_lora_layers=layers)
    pipe.transformer.delete_adapters("new")
    return str(path)


@pytest.fixture(scope="module")
def flux_with_loras(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    pipe = _seeded("tiny-flux")
    pipe.save_pretrained(root / "flux")
    styles = {"ink": make_lora(pipe, root / "ink", 1), "glow": make_lora(pipe, root / "glow", 2)}
    model = load_model(str(root / "flux"), LoadOptions(loras=tuple(styles.items())))
    return root, styles, model


def req(rid, seed, prompt, loras=(), steps=2) -> ResolvedRequest:
    return ResolvedRequest(rid, "m", prompt, None, 32, 32, 1, None, steps, 3.5, (seed,),
                           StepCacheConfig(), False, 0, None, None, time.time(),
                           loras=tuple(loras))


def run(model, *requests):
    return model.generate(list(requests)).frames


def test_lora_equals_diffusers_alone_and_batched(flux_with_loras):
    root, styles, model = flux_with_loras
    assert model.spec.lora_adapters == ("glow", "ink")
    ref = diffusers.DiffusionPipeline.from_pretrained(root / "flux")
    ref.set_progress_bar_config(disable=True)
    for name, path in styles.items():
        ref.load_lora_weights(path, adapter_name=name)
    ref.set_adapters(["glow", "ink"], [0.5, 1.2])
    rows = (("a red cat", 1), ("a blue dog", 2))
    want = _reference(ref, rows, height=32, width=32, guidance_scale=3.5)
    loras = (("glow", 0.5), ("ink", 1.2))
    got = run(model, req("a", 1, "a red cat", loras), req("b", 2, "a blue dog", loras))
    for i in range(2):
        _assert_close(got[i], want[i], 255.0)
    alone = run(model, req("a", 1, "a red cat", loras))
    assert np.array_equal(alone[0], got[0])


def test_adapters_switch_per_batch_and_off_is_the_base_model(flux_with_loras):
    root, _, model = flux_with_loras
    base = load_model(str(root / "flux"))  # no adapters
    plain = run(base, req("p", 1, "a red cat"))[0]
    assert np.array_equal(run(model, req("p", 1, "a red cat"))[0], plain)
    ink = run(model, req("i", 1, "a red cat", (("ink", 1.0),)))[0]
    half = run(model, req("h", 1, "a red cat", (("ink", 0.5),)))[0]
    assert not np.array_equal(ink, plain) and not np.array_equal(half, ink)
    assert np.array_equal(run(model, req("p", 1, "a red cat"))[0], plain)  # switched off
    assert np.array_equal(run(model, req("i", 1, "a red cat", (("ink", 1.0),)))[0], ink)
    # The batcher keeps requests with other adapters or scales apart.
    keys = {req(r, 1, "x", lo).batch_key for r, lo in
            (("a", (("ink", 1.0),)), ("b", (("ink", 1.0),)), ("c", (("ink", 0.5),)), ("d", ()))}
    assert len(keys) == 3


def test_adapter_that_fits_no_layer_is_a_clear_error(tmp_path):
    wan = _seeded("tiny-wan")
    path = make_lora(wan, tmp_path / "wan-lora", 3, targets=["ffn.net.0.proj"])
    with pytest.raises(ValueError, match="does not fit model tiny-flux"):
        load_model("tiny-flux", LoadOptions(loras=(("wanstyle", path),)))


def test_request_for_an_unknown_adapter_or_bad_scale_is_rejected():
    spec = ModelSpec("m", "text-to-image", "flux", 16, 512 * 512, 64, 64, 4, 3.5,
                     lora_adapters=("ink",))
    ok = resolve_request(DiffusionRequest("r", "m", "cat", loras={"ink": 0.7}), spec,
                         StepCacheConfig())
    assert ok.loras == (("ink", 0.7),)
    with pytest.raises(ValueError, match="'pencil' is not loaded for model m"):
        resolve_request(DiffusionRequest("r", "m", "cat", loras={"pencil": 1.0}), spec,
                        StepCacheConfig())
    with pytest.raises(ValueError, match="scale"):
        resolve_request(DiffusionRequest("r", "m", "cat", loras={"ink": 99.0}), spec,
                        StepCacheConfig())
