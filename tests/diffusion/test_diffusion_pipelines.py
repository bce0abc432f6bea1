"""The pipeline families in this process with the embedded tiny models: per-request seeds under
batching, step caching, previews, image-to-image and loading a diffusers folder."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
import torch

from genserve.multimodal_gen.messages import ResolvedRequest, StepCacheConfig, StepDecision
from genserve.multimodal_gen.pipelines import load_model

NO_CACHE = StepCacheConfig()


def req(rid="r", seeds=(1,), prompt="a red cat", size=32, steps=2, frames=1, guidance=3.5,
        cache=NO_CACHE, init_image=None, strength=None) -> ResolvedRequest:
    return ResolvedRequest(rid, "m", prompt, None, size, size, frames, None, steps, guidance,
                           tuple(seeds), cache, False, 0, init_image, strength, time.time())


@pytest.fixture(scope="module")
def flux():
    return load_model("tiny-flux")


@pytest.fixture(scope="module")
def wan():
    return load_model("tiny-wan")


def run(model, *requests):
    """(output, [(step, total)] of the steps run); step 0, before the first, is left out."""
    steps = []

    def on_step(step: int, total: int, tensors: dict) -> StepDecision:
        steps.append((step, total))
        return StepDecision.CONTINUE

    out = model.generate(list(requests), on_step)
    assert steps[0] == (0, steps[-1][1]) and out.decision is StepDecision.CONTINUE
    return out, steps[1:]


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-wan", "shapes-image"])
@pytest.mark.parametrize("stop_at", [0, 1])
@pytest.mark.parametrize("decision", [StepDecision.CANCEL, StepDecision.REGROUP])
def test_a_step_decision_leaves_the_call_at_that_step(name, stop_at, decision):
    """A decision other than CONTINUE ends the pipeline call through diffusers' interrupt flag:
    no denoiser call after it (none at all when taken at step 0), no further hook, no frames."""
    model = load_model(name)
    frames = 5 if name == "tiny-wan" else 1
    calls = []
    hook = model.denoiser.register_forward_pre_hook(lambda *_: calls.append(1))
    steps = []

    def on_step(step: int, total: int, tensors: dict) -> StepDecision:
        steps.append(step)
        return decision if step == stop_at else StepDecision.CONTINUE

    try:
        full, _ = run(model, req(steps=2, frames=frames))
        per_step = len(calls) // 2  # with classifier-free guidance, some call it twice a step
        calls.clear()
        out = model.generate([req(steps=4, frames=frames)], on_step)
        stopped = len(calls)
        again, run_steps = run(model, req(steps=2, frames=frames))  # the model is whole after
    finally:
        hook.remove()
    assert steps == list(range(stop_at + 1))
    assert per_step >= 1 and stopped == per_step * stop_at
    assert out.decision is decision and out.frames == []
    assert len(run_steps) == 2 and np.array_equal(again.frames[0], full.frames[0])


def test_batched_equals_alone_and_seeds_matter(flux):
    a, steps = run(flux, req("a", (1,)))
    assert steps == [(1, 2), (2, 2)]
    b, _ = run(flux, req("b", (2,), "a blue dog"))
    both, _ = run(flux, req("a", (1,)), req("b", (2,), "a blue dog"))
    assert np.array_equal(both.frames[0], a.frames[0])
    assert np.array_equal(both.frames[1], b.frames[0])
    assert a.frames[0].shape == (1, 32, 32, 3) and a.frames[0].dtype == np.uint8
    same_prompt, _ = run(flux, req("c", (2,)))
    assert not np.array_equal(same_prompt.frames[0], a.frames[0])  # only the seed differs


def test_video_batched_equals_alone(wan):
    a, _ = run(wan, req("a", (1,), frames=5, guidance=2.0))
    both, _ = run(wan, req("b", (5,), frames=5, guidance=2.0), req("a", (1,), frames=5,
                                                                   guidance=2.0))
    assert a.frames[0].shape == (5, 32, 32, 3)
    assert np.array_equal(both.frames[1], a.frames[0])


def test_step_cache_threshold_zero_is_exact_and_half_caches(flux):
    plain, _ = run(flux, req(steps=8))
    exact, _ = run(flux, req(steps=8, cache=StepCacheConfig(True, residual_diff_threshold=0.0)))
    assert np.array_equal(exact.frames[0], plain.frames[0]) and exact.cached_steps == 0
    cached, _ = run(flux, req(steps=8, cache=StepCacheConfig(True, residual_diff_threshold=0.5)))
    assert 0 < cached.cached_steps < 8
    # New size and step count with the cache attached: refreshed, not stale.
    other, steps = run(flux, req(size=48, steps=5,
                                 cache=StepCacheConfig(True, residual_diff_threshold=0.5)))
    assert other.frames[0].shape == (1, 48, 48, 3) and len(steps) == 5
    assert other.cached_steps <= 5
    # Capped cached steps and warmup are honoured.
    capped, _ = run(flux, req(steps=8, cache=StepCacheConfig(
        True, residual_diff_threshold=0.5, warmup_steps=3, max_cached_steps=2)))
    assert capped.cached_steps <= 2
    # Turning caching off again gives the uncached pixels back.
    again, _ = run(flux, req(steps=8))
    assert np.array_equal(again.frames[0], plain.frames[0]) and again.cached_steps == 0


def test_step_cache_on_video_with_cfg(wan):
    plain, _ = run(wan, req(steps=6, frames=5, guidance=2.0))
    cached, _ = run(wan, req(steps=6, frames=5, guidance=2.0,
                             cache=StepCacheConfig(True, residual_diff_threshold=0.5)))
    assert cached.cached_steps > 0
    assert cached.frames[0].shape == plain.frames[0].shape


def test_step_cache_is_per_instance(flux):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    run(flux, req(cache=StepCacheConfig(True, residual_diff_threshold=0.5)))
    assert "forward" in vars(flux.pipe.transformer)  # the hook is an instance attribute
    # ... and no class was patched (cache-dit's pipeline path rewrites the class __call__).
    assert FluxTransformer2DModel.forward.__module__.endswith("transformer_flux")
    assert FluxPipeline.__call__.__module__.endswith("pipeline_flux")
    assert not hasattr(FluxPipeline, "_original_call")


def test_previews_projection_and_decode(wan):
    r = req(frames=5, guidance=2.0)
    latents = torch.randn(1, 4, 2, 4, 4)
    cheap = wan.preview({"latents": latents}, r, full_decode=False)
    full = wan.preview({"latents": latents}, r, full_decode=True)
    assert cheap.shape == full.shape == (5, 32, 32, 3) and cheap.dtype == np.uint8
    # The projection is fitted to the VAE: it tracks the real decode far better than grey.
    err = np.abs(cheap.astype(float) - full).mean()
    grey = np.abs(127.5 - full.astype(float)).mean()
    assert err < grey


def test_image_to_image_uses_the_input(flux):
    from PIL import Image

    def png(color):
        buf = io.BytesIO()
        Image.new("RGB", (32, 32), color).save(buf, format="PNG")
        return buf.getvalue()

    red, _ = run(flux, req(init_image=png((255, 0, 0)), strength=0.3, steps=4))
    blue, steps = run(flux, req(init_image=png((0, 0, 255)), strength=0.3, steps=4))
    # Only the re-noised tail of the schedule runs, and progress reports that total.
    assert len(steps) < 4 and steps[-1] == (len(steps), len(steps))
    assert blue.total_steps == len(steps)
    assert red.frames[0][..., 0].mean() > blue.frames[0][..., 0].mean()


def test_load_diffusers_folder(flux, tmp_path):
    flux.pipe.save_pretrained(tmp_path / "my-flux")
    model = load_model(str(tmp_path / "my-flux"))
    assert model.name == "my-flux" and model.spec.family == "flux"
    assert model.spec.default_width == 1024  # a real checkpoint's defaults
    out, _ = run(model, req())
    ref, _ = run(flux, req())
    assert np.array_equal(out.frames[0], ref.frames[0])


@pytest.mark.parametrize("name, frames, guidance, caches", [
    ("tiny-sd3", 1, 4.0, True), ("tiny-sd", 1, 4.0, False), ("tiny-ltx", 9, 3.0, True),
])
def test_other_families_generate_batch_and_cache(name, frames, guidance, caches):
    model = load_model(name)
    size = model.spec.size_factor * 2 if name == "tiny-ltx" else 32

    def r(rid, seed, prompt, **kw):
        return req(rid, (seed,), prompt, size=size, frames=frames, guidance=guidance, **kw)

    alone, steps = run(model, r("a", 1, "a red cat"))
    assert alone.frames[0].shape == (frames, size, size, 3) and steps[-1] == (2, 2)
    both, _ = run(model, r("b", 2, "a blue dog"), r("a", 1, "a red cat"))
    assert np.array_equal(both.frames[1], alone.frames[0])
    assert not np.array_equal(both.frames[0], alone.frames[0])
    latents = torch.zeros(1, 4 if name != "tiny-ltx" else 8, 1, 2, 2)
    preview = model.preview({"latents": latents}, r("a", 1, "x"), full_decode=False)
    assert preview.shape == (frames, size, size, 3)
    cached, _ = run(model, r("c", 1, "a red cat", steps=8,
                             cache=StepCacheConfig(True, residual_diff_threshold=0.5)))
    assert (cached.cached_steps > 0) == caches


def test_batch_invariant_layers_match_row_by_row():
    from genserve.multimodal_gen.batch_invariance import make_batch_invariant

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 2, stride=2), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 4 * 4, 16))
    assert make_batch_invariant(model) == 2
    x = torch.randn(7, 3, 8, 8)
    with torch.no_grad():
        rows = [model(x[i : i + 1]) for i in range(7)]
        for batch in range(1, 8):
            out = model(x[:batch])
            for i in range(batch):
                assert torch.equal(out[i], rows[i][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_linear_per_sample_vectors(dtype):
    """[samples, features] inputs (timestep embeddings): a sample's output is the same alone,
    at any place in a batch of any size, and from a row that sits at an unaligned offset."""
    from genserve.multimodal_gen.batch_invariance import make_batch_invariant

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(37, 96), torch.nn.SiLU(),
                                torch.nn.Linear(96, 200)).to(dtype)
    make_batch_invariant(model)
    x = torch.randn(40, 37, dtype=dtype)
    with torch.no_grad():
        alone = [model(x[i : i + 1].clone()) for i in range(40)]
        for start, batch in ((0, 40), (1, 17), (3, 2), (5, 1)):  # views at odd offsets too
            out = model(x[start : start + batch])
            assert out.shape == (batch, 200)
            for i in range(batch):
                assert torch.equal(out[i], alone[start + i][0])


def test_image_vae_runs_channels_last_and_decodes_as_before(flux, wan):
    import copy

    from genserve.multimodal_gen.pipelines.base import channels_last_vae

    vae = flux.pipe.vae
    weights = [p for p in vae.parameters() if p.ndim == 4]
    assert weights and all(p.is_contiguous(memory_format=torch.channels_last) for p in weights)
    plain = copy.deepcopy(vae).to(memory_format=torch.contiguous_format)
    assert not plain.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    z = torch.randn(2, 4, 8, 12, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        fast, ref = vae.decode(z).sample, plain.decode(z).sample
    assert fast.shape == ref.shape == (2, 3, 64, 96)
    assert (fast - ref).abs().max() < 1e-4
    assert not channels_last_vae(wan.pipe.vae)  # 3D convolutions keep their layout
    assert not channels_last_vae(None)


def test_relative_position_bias_is_computed_once_per_length():
    from genserve.multimodal_gen.embedded import _tiny_t5_encoder
    from genserve.multimodal_gen.pipelines.position_tables import remember_relative_bias

    torch.manual_seed(0)
    encoder = _tiny_t5_encoder(32)
    with torch.inference_mode():
        plain = {n: encoder(torch.arange(2, 2 + n)[None]).last_hidden_state for n in (9, 12)}
    assert remember_relative_bias(encoder) == 1  # T5: the first layer's attention
    assert remember_relative_bias(encoder) == 0  # never wrapped twice
    attn = next(m for m in encoder.modules() if "compute_bias" in vars(m))
    buckets = []
    bucket = attn._relative_position_bucket
    attn._relative_position_bucket = lambda *a, **k: buckets.append(1) or bucket(*a, **k)
    with torch.inference_mode():
        for n in (9, 9, 12, 9, 12):
            out = encoder(torch.arange(2, 2 + n)[None]).last_hidden_state
            assert torch.equal(out, plain[n])
        assert len(buckets) == 2  # once per length
        attn.relative_attention_bias.weight.mul_(2.0)  # new weights in place: computed afresh
        changed = encoder(torch.arange(2, 11)[None]).last_hidden_state
        assert len(buckets) == 3 and not torch.equal(changed, plain[9])
    encoder(torch.arange(2, 11)[None])  # outside inference mode nothing is kept
    assert len(buckets) == 4


def test_relative_bias_of_an_unknown_signature_is_computed_as_it_comes():
    from genserve.multimodal_gen.pipelines.position_tables import remember_relative_bias

    class Attention(torch.nn.Module):  # a later compute_bias with one more argument
        def __init__(self):
            super().__init__()
            self.relative_attention_bias = torch.nn.Embedding(8, 2)
            self.calls = 0

        def compute_bias(self, query_length, key_length, device=None, past_seen_tokens=0,
                         cache_position=None):
            self.calls += 1
            return torch.zeros(1, 2, query_length, key_length)

    attn = Attention()
    assert remember_relative_bias(attn) == 1
    with torch.inference_mode():
        attn.compute_bias(4, 4, None, 0), attn.compute_bias(4, 4, device=None)
        assert attn.calls == 1  # the known signature, positional or by name: kept
        attn.compute_bias(4, 4, cache_position=torch.arange(4))
        attn.compute_bias(4, 4, cache_position=torch.arange(4))
        assert attn.calls == 3


def test_position_tables_keep_a_few_small_results(monkeypatch):
    from genserve.multimodal_gen.pipelines import position_tables as pt

    calls = []
    table = pt._remember(lambda n: calls.append(n) or torch.zeros(n), key=lambda n: n)
    with torch.inference_mode():
        assert table(4) is table(4) and calls == [4]
        monkeypatch.setattr(pt, "KEEP_BYTES", 64)
        table(32), table(32)  # 128 bytes: too big to keep, built each time
        assert calls == [4, 32, 32]
        for n in range(5, 5 + pt.KEEP):  # KEEP newer sizes push the oldest out
            table(n)
        table(4)
        assert calls[-1] == 4 and len(calls) == 3 + pt.KEEP + 1


def test_flux_rope_tables_are_kept_across_steps(flux):
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    pos_embed = flux.denoiser.pos_embed
    assert "forward" in vars(pos_embed)
    fresh = FluxPosEmbed(theta=10000, axes_dim=[4, 6, 6])
    ids = torch.cat([torch.zeros(5, 3), torch.stack(torch.meshgrid(
        torch.zeros(1), torch.arange(4.0), torch.arange(6.0), indexing="ij"), -1).reshape(-1, 3)])
    with torch.inference_mode():
        first = pos_embed(ids)
        assert pos_embed(ids.clone()) is first  # equal ids: the kept tables
        shifted = ids.clone()
        shifted[-1, 2] += 1
        for got, want in zip(pos_embed(shifted), fresh(shifted), strict=True):
            assert torch.equal(got, want)
        for got, want in zip(first, fresh(ids), strict=True):
            assert torch.equal(got, want)
    assert pos_embed(ids) is not first  # outside inference mode: computed


def test_flux_rope_tables_of_bf16_ids_are_kept():
    # A bf16 pipeline on a CPU passes bf16 position ids; numpy has no bfloat16 (the key of the
    # kept tables used to raise TypeError there: found by scripts/device_check.sh --dry-run).
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    from genserve.multimodal_gen.pipelines.position_tables import remember_rope

    pos_embed = FluxPosEmbed(theta=10000, axes_dim=[4, 6, 6])
    remember_rope(pos_embed)
    ids = torch.arange(24.0).reshape(8, 3).to(torch.bfloat16)
    with torch.inference_mode():
        first = pos_embed(ids)
        assert pos_embed(ids.clone()) is first
        assert pos_embed(ids + 1) is not first


def test_unsupported_folder_is_a_clear_error(tmp_path):
    (tmp_path / "model_index.json").write_text('{"_class_name": "KandinskyPipeline"}')
    with pytest.raises(ValueError, match="not supported"):
        load_model(str(tmp_path))
