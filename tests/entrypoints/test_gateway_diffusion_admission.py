"""Diffusion requests go through the same admission as LLM requests: one queue limit per model
(`--max-queued-requests`), 503 in the error envelope when it is full, the slot back when the
request ends. A real uvicorn server, the in-process fake diffusion client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import websockets

from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from tests.realtime.client import ws_url
from tests.realtime.fake_diffusion import FakeDiffusionClient
from tests.realtime.server import serve

pytestmark = pytest.mark.timeout(60)


def _wait_job(http: httpx.Client, job_id: str) -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        job = http.get(f"/v1/videos/{job_id}").json()
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"video job {job_id} did not finish")


def test_full_diffusion_queue_is_503_and_the_slot_comes_back(tmp_path, monkeypatch):
    monkeypatch.setenv("GENSERVE_OUTPUT_DIR", str(tmp_path))
    fake = FakeDiffusionClient(step_delay_s=0.1)
    app = create_app(GatewayConfig(max_queued_requests=1), [], fake)
    state = app.state.gateway
    with serve(app) as base, httpx.Client(base_url=base, timeout=30) as http:
        body = {"model": "fake-video", "prompt": "a red ball", "num_frames": 5,
                "num_inference_steps": 8}
        first = http.post("/v1/videos", json=body)
        assert first.status_code == 200, first.text
        assert state.in_flight["fake-video"] == 1

        refused = http.post("/v1/videos", json=body)
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert error["code"] == "queue_full" and "fake-video" in error["message"]
        assert state.metrics.registry.get_sample_value(
            "genserve:num_rejected_requests_total",
            {"model_name": "fake-video", "status": "503"}) == 1

        assert _wait_job(http, first.json()["id"])["status"] == "completed"
        assert state.in_flight["fake-video"] == 0
        state.admission.check_integrity()

        again = http.post("/v1/videos", json=body)
        assert again.status_code == 200
        assert http.delete(f"/v1/videos/{again.json()['id']}").json()["status"] == "cancelled"
        _wait_job(http, again.json()["id"])
    assert state.in_flight["fake-video"] == 0
    assert fake.running == set()


def test_a_realtime_chunk_over_the_limit_gets_an_error_message(tmp_path, monkeypatch):
    monkeypatch.setenv("GENSERVE_OUTPUT_DIR", str(tmp_path))
    fake = FakeDiffusionClient(step_delay_s=0.1)
    app = create_app(GatewayConfig(max_queued_requests=1), [], fake)
    with serve(app) as base, httpx.Client(base_url=base, timeout=30) as http:
        job = http.post("/v1/videos", json={"prompt": "a ball", "num_inference_steps": 8})
        assert job.status_code == 200

        async def start_session() -> dict:
            async with websockets.connect(ws_url(base)) as ws:
                await ws.send(json.dumps({"type": "start", "prompt": "a cat"}))
                while True:
                    message = json.loads(await ws.recv())
                    if message["type"] == "error":
                        return message

        error = asyncio.run(start_session())
        assert error["code"] == "unavailable" and "queue" in error["message"]
        _wait_job(http, job.json()["id"])
