"""The transport part of benchmarks/bench_realtime.py goes through the real realtime session:
its replay engine's previews reach a client over the gateway's WebSocket with the protocol's
messages, and the `chunk_done` drop count accounts for every preview that did not arrive.

Counts and order only; the benchmark measures the speed."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_realtime.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_realtime", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rate", [120.0, None], ids=["paced", "unpaced"])
def test_previews_go_through_the_session_and_are_accounted_for(bench, rate):
    steps = 60
    r = bench.bench_session_transport(steps, rate, quality=80, noise=25.0, client_process=False)
    types = r["message_types"]
    assert types[0] == "started" and types[-1] == "done"
    assert types.count("progress") == steps  # one per engine step, none dropped
    assert types.count("chunk_done") == 1 and types.index("chunk_done") < len(types) - 1
    assert r["finals"] == 1
    # Previews arrive in step order, the newest is never dropped, and every step's preview was
    # either delivered or counted as dropped by the sender.
    delivered = r["preview_steps"]
    assert delivered == sorted(set(delivered)) and delivered[-1] == steps
    assert set(delivered) <= set(range(1, steps + 1))
    assert r["previews_received"] == len(delivered) == steps - r["previews_dropped"]
    # chunk_done's count is taken while up to two previews may still be on their way (one
    # being encoded or written, one pending); none is dropped after the last step.
    assert len(delivered) - 2 <= r["previews_sent"] <= len(delivered)
    # A preview is decoded after the engine yielded it (one monotonic clock).
    assert r["delay_ms_p50"] >= 0 and r["delay_ms_max"] >= r["delay_ms_p95"] >= 0
    assert r["bytes_per_frame"] > 0

