"""`--diffusion-workers 2`: two real worker processes behind one pool. A seeded request gives
the same pixels on either worker; same-shape requests stay on one worker (so they can batch)
while another shape goes to the idle one; `genserve serve` serves through the pool over HTTP."""

from __future__ import annotations

import asyncio
import base64
import io
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from PIL import Image

from genserve.multimodal_gen.launch import start_diffusion_client, worker_device
from genserve.multimodal_gen.messages import DiffusionRequest, ResultEvent
from genserve.multimodal_gen.worker_pool import DiffusionWorkerPool
from tests.serve_process import free_port


@pytest.fixture(scope="module")
def pool():
    args = SimpleNamespace(diffusion_workers=2, diffusion_max_batch_size=4,
                           diffusion_batch_delay_ms=50.0)
    client = start_diffusion_client(["tiny-flux"], args)
    assert isinstance(client, DiffusionWorkerPool) and len(client.workers) == 2
    yield client
    asyncio.run(client.shutdown())


def _req(rid: str, seed: int, size: int = 32) -> DiffusionRequest:
    return DiffusionRequest(rid, "tiny-flux", "a red cat", seed=seed, num_inference_steps=2,
                            width=size, height=size, progress=False)


async def _result(client, req) -> ResultEvent:
    events = [e async for e in client.stream(req)]
    assert isinstance(events[-1], ResultEvent), events[-1]
    return events[-1]


def test_a_seeded_request_gives_the_same_pixels_on_either_worker(pool):
    async def main():
        return [await _result(worker, _req(f"w{i}", 7)) for i, worker in
                enumerate(pool.workers)]

    first, second = asyncio.run(main())
    assert np.array_equal(first.outputs[0], second.outputs[0])


def test_same_shape_requests_stay_together_and_another_shape_spreads(pool):
    before = [s["served"] for s in pool.stats()]

    async def main():
        tasks = [asyncio.create_task(_result(pool, _req("a1", 1))),
                 asyncio.create_task(_result(pool, _req("b1", 2, size=48))),
                 asyncio.create_task(_result(pool, _req("a2", 3))),
                 asyncio.create_task(_result(pool, _req("a3", 4)))]
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    placed = [s["served"] - b for s, b in zip(pool.stats(), before, strict=True)]
    assert sorted(placed) == [1, 3]  # the three 32x32 on one worker, the 48x48 on the other
    assert results[1].outputs[0].shape == (1, 48, 48, 3)
    assert all(s["in_flight"] == 0 for s in pool.stats())
    report = pool.runtime_report()
    assert report["state"] == "ready" and len(report["workers"]) == 2


def test_cancel_reaches_the_worker_that_holds_the_request(pool):
    async def main():
        req = DiffusionRequest("long", "tiny-flux", "a cat", seed=1, num_inference_steps=100,
                               width=32, height=32)
        stream = pool.stream(req)
        await stream.__anext__()  # its first step ran: it is on a worker
        assert await pool.cancel("long")
        return [e async for e in stream]

    events = asyncio.run(main())
    assert events[-1].status == 499
    assert not asyncio.run(pool.cancel("long"))  # ended: unknown now


def test_worker_devices():
    assert worker_device("auto", 1, 2) == "auto:1"
    assert worker_device("cuda", 1, 2) == "cuda:1"
    assert worker_device("cpu", 1, 2) == "cpu"
    assert worker_device("auto", 0, 1) == "auto"


def test_serve_with_two_diffusion_workers_over_http():
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--no-llm", "--port",
         str(port), "--diffusion-model-path", "tiny-flux", "--diffusion-workers", "2"],
        stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.seek(0) or log.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

        async def main():
            async with httpx.AsyncClient(timeout=300) as http:
                return await asyncio.gather(*(http.post(url + "/v1/images/generations", json={
                    "model": "tiny-flux", "prompt": "a red cat", "size": size, "seed": 3,
                    "num_inference_steps": 2, "response_format": "b64_json"})
                    for size in ("32x32", "48x48")))

        for r, side in zip(asyncio.run(main()), (32, 48), strict=True):
            assert r.status_code == 200, r.text
            png = base64.b64decode(r.json()["data"][0]["b64_json"])
            assert Image.open(io.BytesIO(png)).size == (side, side)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
