"""The diffusion worker's report for the memory plan: weights, a peak and the warm-up call the
CUDA path measures (run here on the CPU, where the peak is estimated instead)."""

from __future__ import annotations

import pytest

from genserve.multimodal_gen.memory_report import (
    estimated_peak,
    memory_report,
    resident_bytes,
    warm_up_request,
)
from genserve.multimodal_gen.pipelines import LoadOptions, load_model


@pytest.fixture(scope="module")
def tiny():
    return {name: load_model(name, LoadOptions(dtype="float32", device="cpu"))
            for name in ("tiny-flux", "tiny-wan", "tiny-flux-kontext", "tiny-helios")}


def test_the_warm_up_call_is_the_largest_configured_one_and_runs(tiny):
    flux = tiny["tiny-flux"]
    req = warm_up_request(flux, rows=3)
    spec = flux.spec
    assert (req.width, req.height, req.num_outputs) == (spec.default_width,
                                                         spec.default_height, 3)
    assert req.num_inference_steps == spec.min_steps
    out = flux.generate([req])  # what measured_peak runs on CUDA
    assert len(out.frames) == 3
    assert warm_up_request(flux, rows=64).num_outputs == 8  # a request's output cap
    # Edit and streaming models need inputs a warm-up cannot invent: their peak is estimated.
    assert warm_up_request(tiny["tiny-flux-kontext"], rows=1) is None
    assert warm_up_request(tiny["tiny-helios"], rows=1) is None


def test_the_host_report_counts_every_weight_and_estimates_the_peak(tiny):
    wan = tiny["tiny-wan"]
    weights = sum(t.numel() * t.element_size() for c in wan.pipe.components.values()
                  if hasattr(c, "parameters") for t in (*c.parameters(), *c.buffers()))
    assert resident_bytes(wan, on_host=True) == (weights, 0)  # nothing to offload on a host
    report = memory_report({"tiny-wan": wan}, max_batch_size=2)
    assert report["device"] == "cpu" and report["total_bytes"] > report["free_bytes"] > 0
    [model] = report["models"]
    assert model["weights_bytes"] == weights and model["peak_source"] == "estimated"
    assert model["peak_bytes"] == estimated_peak(wan, 2) > 0
    spec = wan.spec
    assert model["call"] == (f"{spec.default_width}x{spec.default_height}"
                             f"x{spec.default_num_frames} frames, batch 2")
    # More rows per call never lower the estimate.
    assert estimated_peak(wan, 4) >= estimated_peak(wan, 2)
