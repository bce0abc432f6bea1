"""Shared fixtures: one diffusion worker (tiny-flux, tiny-wan and the three demo models) and one
real uvicorn server on 127.0.0.1 for the whole session (starting a worker costs seconds: torch +
diffusers imports)."""

from __future__ import annotations

import asyncio

import pytest

from genserve import envs
from tests.diffusion.helpers import LiveServer


def _threads() -> int:
    return envs.GENSERVE_TEST_THREADS.get() or 1


@pytest.fixture(scope="session")
def output_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("genserve-outputs")
    mp = pytest.MonkeyPatch()
    mp.setenv("GENSERVE_OUTPUT_DIR", str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="session")
def diffusion_client():
    from genserve.multimodal_gen.engine_client import WorkerDiffusionClient
    from genserve.multimodal_gen.worker import WorkerConfig

    client = WorkerDiffusionClient(WorkerConfig(
        ("tiny-flux", "tiny-wan", "shapes-image", "shapes-video", "shapes-stream"),
        num_threads=_threads(),
        max_batch_size=4, batch_delay_ms=150))
    yield client
    asyncio.run(client.shutdown())


@pytest.fixture(scope="session")
def server(diffusion_client, output_dir):
    from genserve.entrypoints.app import create_app
    from genserve.entrypoints.config import GatewayConfig

    app = create_app(GatewayConfig(), llm_clients=[], diffusion_client=diffusion_client)
    live = LiveServer(app)
    live.output_dir = output_dir
    yield live
    live.stop()


@pytest.fixture
def http(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
