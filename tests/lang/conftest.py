"""A real `genserve serve` (embedded SmolLM2, float32: `server_url` in tests/conftest.py) and
an in-process Engine, the two backends genserve.lang programs run on."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def http_backend(server_url):
    from genserve.lang import RuntimeEndpoint

    backend = RuntimeEndpoint(server_url)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def engine_backend():
    from genserve import Engine
    from genserve.lang import EngineBackend

    return EngineBackend(Engine(dtype="float32", max_total_tokens=16384))


@pytest.fixture(params=["http", "engine"])
def backend(request):
    return request.getfixturevalue(f"{request.param}_backend")
