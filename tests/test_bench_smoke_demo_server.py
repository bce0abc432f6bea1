"""The benchmarks that can measure a running server (`--url`) run `--smoke` against the
session's demo-model server (`shapes_demo_server`: shapes-vl, shapes-image, shapes-video)
instead of starting their own: their tables and JSON summaries have their shape (speed is not
checked)."""

from __future__ import annotations

import re

import pytest

from tests.bench_scripts import has_keys, last_json, run_smoke

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_bench_coschedule(shapes_demo_server):
    out = run_smoke("bench_coschedule", "--url", shapes_demo_server, timeout=120)
    s = last_json(out)
    has_keys(
        s, "alone", "together", "ratios", "targets", "met", "thread_split", "frame_interval_ms"
    )
    for part in (s["alone"], s["together"]):
        has_keys(part["realtime"], "frames", "gap_p50_ms", "gap_p99_ms")
        has_keys(part["chat"], "requests", "ttft_p50_ms", "ttft_p95_ms")
        images = part["images"]["images"]  # whole bursts of 2 (--smoke)
        assert images >= 2 and images % 2 == 0 and part["images"]["images_per_s"] > 0
        assert part["chat"]["requests"] >= 2 and part["realtime"]["frames"] >= 2
    assert set(s["ratios"]) == set(s["targets"]) == set(s["met"])
    assert "realtime_gap_ratio" in out and "target" in out


def test_bench_shapes_vl(shapes_demo_server):
    """The shared server is the radix-cache side; the script starts its side without it."""
    s = last_json(run_smoke("bench_shapes_vl", "--url", shapes_demo_server))
    for server in ("radix_cache", "no_radix_cache"):
        row = s[server]
        for part in ("batch1_new_picture", "batch1_same_picture", "concurrent2_same_picture"):
            has_keys(row[part], "median_ms", "max_ms")
        assert row["concurrent2_same_picture"]["wall_ms"] > 0
        assert re.fullmatch(r"[0-4]/4", row["answers_right"])
