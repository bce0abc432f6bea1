"""A real `genserve serve` (embedded SmolLM2, float32) and an in-process Engine, the two
backends genserve.lang programs run on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.needs import smollm2_folder
from tests.serve_process import serve_process


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    # Only the embedded SmolLM2 (its GGUF named), not the default second LLM (shapes-vl).
    gguf = smollm2_folder() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with serve_process("--model-path", str(gguf), "--max-total-tokens", "16384") as url:
        yield url


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
