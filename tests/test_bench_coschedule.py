"""benchmarks/bench_coschedule.py --smoke against the session's demo-model server: the table and
the JSON summary have their shape (speed is not checked)."""

from __future__ import annotations

import pytest

from tests.bench_scripts import has_keys, last_json, run_smoke

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_coschedule_smoke(shapes_demo_server):
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
