"""`genserve serve` makes one memory plan before it listens: /get_server_info shows it, and a
start that cannot fit exits with what would, without ever serving."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.serve_process import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_server_info_shows_the_plan_the_pool_was_sized_by(shapes_demo_server):
    # The session's demo-model server, started without --max-total-tokens.
    info = httpx.get(shapes_demo_server + "/get_server_info", timeout=30).json()
    [plan] = info["memory_plan"]["devices"]
    assert plan["device"] == "cpu" and plan["fraction"] == 0.85
    assert plan["budget_bytes"] <= plan["total_bytes"] * 0.85
    [llm] = plan["llms"]
    assert llm["name"] == "shapes-vl" and llm["weights_bytes"] > 0
    # On a host the runtime's own default pool stands while it fits: the plan reports it.
    assert llm["kv_pool_tokens"] == info["max_total_tokens"]
    assert llm["kv_pool_source"] == "host default"
    assert sorted(d["name"] for d in plan["diffusion"]) == ["shapes-image", "shapes-video"]
    for diffusion in plan["diffusion"]:
        assert diffusion["weights_bytes"] > 0
        assert diffusion["peak_source"] == "estimated" and diffusion["peak_bytes"] > 0
    assert plan["headroom_bytes"] > 0


def test_a_start_that_cannot_fit_says_what_would_and_never_listens():
    port = free_port()
    cmd = [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--port", str(port),
           "--dtype", "float32", "--quantization", "none", "--no-compile",
           "--model-path", "shapes-vl", "--diffusion-model-path", "shapes-image",
           "--mem-fraction", "0.001"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert result.returncode != 0
    assert "the memory plan for cpu does not fit" in result.stderr
    assert "What would fit: " in result.stderr and "--mem-fraction 0.95" in result.stderr
    assert "listening" not in result.stderr
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
