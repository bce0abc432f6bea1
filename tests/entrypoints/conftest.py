"""A real uvicorn server on 127.0.0.1 (free port) around the gateway and a fake engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn

from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from tests.entrypoints.gateway_fakes import FakeEngine


@dataclass
class RunningServer:
    url: str
    engine: FakeEngine
    config: GatewayConfig


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # runs in a thread: no signal handlers
        pass


def start_server(app: Any) -> tuple[_Server, threading.Thread, str]:
    server = _Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                    lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture
def make_server() -> Iterator[Callable[..., RunningServer]]:
    started: list[tuple[_Server, threading.Thread]] = []

    def factory(engine: FakeEngine | None = None, **config: Any) -> RunningServer:
        engine = engine or FakeEngine()
        cfg = GatewayConfig(**config)
        server, thread, url = start_server(create_app(cfg, [engine]))
        started.append((server, thread))
        return RunningServer(url, engine, cfg)

    yield factory
    for server, thread in started:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def server(make_server: Callable[..., RunningServer]) -> RunningServer:
    return make_server()


@pytest.fixture(scope="session")
def shared_real_server(tmp_path_factory) -> Iterator[Any]:
    """The embedded SmolLM2 and a diffusion worker (tiny-flux, tiny-wan) behind one gateway on a
    real uvicorn server (`tests/entrypoints/real_server.py`), started once for the modules that
    need a real runtime: each start costs tens of seconds on a 2-core CPU."""
    from tests.needs import smollm2_folder

    smollm2_folder()
    from tests.entrypoints.real_server import RealServer

    mp = pytest.MonkeyPatch()
    mp.setenv("GENSERVE_OUTPUT_DIR", str(tmp_path_factory.mktemp("outputs")))
    live = RealServer(diffusion_models=("tiny-flux", "tiny-wan"))
    try:
        live.start()
        yield live
    finally:
        live.stop()
        mp.undo()


SMOL_API_KEY = "client-api-test-key"


@pytest.fixture(scope="session")
def smol_api_server() -> Iterator[str]:
    """`genserve serve` on the embedded SmolLM2 alone (4096 KV tokens, `--api-key
    SMOL_API_KEY`), started once for the modules that test a client protocol against it
    (Anthropic, Ollama, Responses); yields its URL."""
    from tests.needs import smollm2_folder
    from tests.serve_process import serve_process

    with serve_process("--model-path", str(smollm2_folder()), "--max-total-tokens", "4096",
                       "--api-key", SMOL_API_KEY) as url:
        yield url


@pytest.fixture(scope="session")
def default_models_server() -> Iterator[str]:
    """`genserve serve --max-total-tokens 4096` with no model argument (SmolLM2 and shapes-vl),
    started once for the modules that ask shapes-vl by name; yields its URL."""
    from tests.serve_process import serve_process

    with serve_process("--max-total-tokens", "4096") as url:
        yield url
