"""The diffusion and streaming benchmarks under benchmarks/ run end to end at a toy size
(`--smoke`: the embedded tiny models, 32-64 px, 1-2 steps, 1-2 requests, one round), each in
its own process, and print the summary they would print at full size: these tests check its
shape (the rows, the keys, the kinds of values), never a speed. (bench_shapes_vl runs against
the shared demo-model server: tests/test_bench_smoke_demo_server.py.)"""

from __future__ import annotations

import json

import pytest

from tests.bench_scripts import has_keys, last_json, run_smoke

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SPREAD_ACROSS_WORKERS = True  # each script runs in its own process; nothing shared


def test_bench_diffusion(tmp_path):
    out = tmp_path / "out.json"
    run_smoke("bench_diffusion", "--json-out", str(out))
    s = json.loads(out.read_text())
    o = s["overhead"]
    assert o["pairs"] == 1 and len(o["round_ratios"]) == 1
    # The gate is HTTP against genserve's own pipeline; plain diffusers is information.
    assert o["ratio"] == pytest.approx(o["http_s"] / o["genserve_pipeline_s"])
    has_keys(o, "plain_diffusers_s", "ratio_vs_plain_diffusers", "worker_ms", "pass")
    assert "genserve's pipeline" in o["target"]
    assert o["same_image"] is True, o  # three sides, one seed: one image
    for part in ("batching", "lora_batching"):
        b = s[part]
        assert b["requests"] == 2 and len(b["rounds"]) == 1
        assert all(1 <= size <= 2 for size in b["rounds"][0]["batch_sizes"])
        has_keys(b, "throughput_ratio", "pass")
    has_keys(s["step_cache"], "cached_steps", "speedup", "mad", "psnr_db", "pass")
    assert s["step_cache_demo"]["prompts"] == 1
    has_keys(s["step_cache_demo"], "accuracy_uncached", "accuracy_cached")
    families = s["family_step_cache"]
    assert set(families) == {"tiny-qwen-image", "tiny-flux-kontext", "tiny-flux-fill",
                             "tiny-wan-i2v"}
    for row in families.values():
        assert {"0.08", "0.5"} <= set(row)
        has_keys(row["0.5"], "cached_steps", "speedup", "psnr_db")


def test_bench_diffusion_cp():
    s = last_json(run_smoke("bench_diffusion_cp"))
    assert (s["cp"], s["requests"]) == (2, 1)
    assert s["cp1_s"] > 0 and s["cp2_s"] > 0 and s["cp2_speedup"] > 0
    assert s["max_pixel_diff"] <= 1  # the two settings draw the same pixels


def test_bench_streaming():
    s = last_json(run_smoke("bench_streaming"))
    assert s["first_frame"]["sessions"] == 1 and s["first_frame"]["first_final_ms_median"] > 0
    assert s["sustained"]["chunks"] == 2 and s["sustained"]["frames"] > 0
    has_keys(s["memory"], "rss_after_warmup_mb", "rss_end_mb", "rss_growth_pct")
    b = s["batched"]
    assert (b["streams"], b["chunks_each"]) == (2, 1)
    has_keys(b, "sequential_frames_per_s", "concurrent_frames_per_s", "speedup")
