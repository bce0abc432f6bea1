"""`shapes-stream`'s parameterizations (`stream_model.Parameterization`): each turns its ideal
network output back into the clean chunk, EDM's scalings are the least-variance ones, and the
choice travels in the exported folder to the served sampler."""

from __future__ import annotations

import json

import pytest
import torch

from genserve.demo_models.stream_model import (
    Parameterization,
    ShapesStreamPipeline,
    build_stream_pipeline,
    history_inputs,
)

SHAPE = (2, 8, 3, 4, 4)  # [B, C, F, h, w]


def _noised(sd: float = 1.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x0 = sd * torch.randn(SHAPE, generator=g, dtype=torch.float64)
    noise = torch.randn(SHAPE, generator=g, dtype=torch.float64)
    sigma = torch.tensor([0.9, 0.25], dtype=torch.float64)
    s = sigma.view(-1, 1, 1, 1, 1)
    return x0, noise, sigma, (1 - s) * x0 + s * noise


def test_each_prediction_gives_back_the_clean_chunk_from_its_target():
    x0, noise, sigma, xs = _noised()
    targets = {"sample": x0, "velocity": noise - x0}
    for kind, target in targets.items():
        clean = Parameterization(kind).clean(target, xs, sigma)
        assert torch.allclose(clean, x0, atol=1e-12), kind
    # The velocity is noise - x0, not x0 - noise: the other sign lands elsewhere.
    assert not torch.allclose(Parameterization("velocity").clean(x0 - noise, xs, sigma), x0)
    # A zero output: x-prediction draws nothing, the skip forms keep (a share of) the input.
    zero = torch.zeros(SHAPE, dtype=torch.float64)
    assert torch.equal(Parameterization("sample").clean(zero, xs, sigma), zero)
    assert torch.allclose(Parameterization("velocity").clean(zero, xs, sigma), xs)


def test_edm_scalings_are_the_closed_form_and_the_least_variance_target():
    edm = Parameterization("edm", sigma_data=1.0)
    c_skip, c_out = edm.scalings(torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64))
    # s = 1: pure x-prediction; s = 0.5: D^2 = 0.5; s = 0: the input itself.
    assert torch.allclose(c_skip, torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64))
    assert torch.allclose(c_out, torch.tensor([1.0, 0.5 / 0.5**0.5, 0.0], dtype=torch.float64))
    # With clean latents of std sd, the network's target (x0 - c_skip x_s) / c_out has unit
    # variance and carries nothing of x_s linearly (c_skip is the regression of x0 on x_s).
    sd = 0.5
    param = Parameterization("edm", sigma_data=sd)
    g = torch.Generator().manual_seed(1)
    n = 200_000
    x0 = sd * torch.randn(n, generator=g, dtype=torch.float64)
    noise = torch.randn(n, generator=g, dtype=torch.float64)
    for s in (0.9, 0.5, 0.1):
        xs = (1 - s) * x0 + s * noise
        c_skip, c_out = param.scalings(torch.tensor(s, dtype=torch.float64))
        target = (x0 - c_skip * xs) / c_out
        assert target.var().item() == pytest.approx(1.0, abs=0.02), s
        assert torch.corrcoef(torch.stack([target, xs]))[0, 1].abs().item() < 0.01, s
    x0, _, sigma, xs = _noised(sd)
    c_skip, c_out = (c.view(-1, 1, 1, 1, 1) for c in param.scalings(sigma))
    assert torch.allclose(param.clean((x0 - c_skip * xs) / c_out, xs, sigma), x0)


def test_a_bad_parameterization_is_refused():
    with pytest.raises(ValueError, match="prediction must be one of"):
        Parameterization("eps")
    with pytest.raises(ValueError, match="sigma_data"):
        Parameterization("edm", sigma_data=0.0)


def test_the_export_carries_the_parameterization_to_the_served_velocity(tmp_path):
    """Saved in model_index.json, read back by the pipeline whose `velocity` the serving
    family steps with; a folder from before the option loads as x-prediction."""
    pipe = build_stream_pipeline(param=Parameterization("edm", sigma_data=0.7))
    torch.nn.init.zeros_(pipe.transformer.proj_out.weight)  # the network's output is 0
    torch.nn.init.zeros_(pipe.transformer.proj_out.bias)
    pipe.save_pretrained(tmp_path, safe_serialization=True)
    served = ShapesStreamPipeline.from_pretrained(tmp_path)
    assert served.parameterization == Parameterization("edm", sigma_data=0.7)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 12, 9, 16, 16, generator=g)
    history = torch.randn(1, 12, 19, 16, 16, generator=g)
    inputs = history_inputs(history, history[:, :, :1])
    embeds = served.encode_prompt("a red circle moving right on a black background")[0]
    timestep = torch.tensor([250.0])
    with torch.no_grad():
        v = served.velocity(x, timestep, embeds, inputs)
    c_skip, _ = served.parameterization.scalings(torch.tensor(0.25))
    assert torch.allclose(v, (1 - c_skip) * x / 0.25, atol=1e-5)  # clean = c_skip x

    index = tmp_path / "model_index.json"
    config = json.loads(index.read_text())
    del config["prediction"], config["sigma_data"]
    index.write_text(json.dumps(config))
    old = ShapesStreamPipeline.from_pretrained(tmp_path)
    assert old.parameterization == Parameterization("sample")
    with torch.no_grad():
        assert torch.allclose(old.velocity(x, timestep, embeds, inputs), x / 0.25)  # clean 0
