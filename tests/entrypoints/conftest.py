"""A real uvicorn server on 127.0.0.1 (free port) around the gateway and a fake engine."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

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
    (Anthropic, Ollama, Responses); yields its URL. Pinned to int8wo weights, as `server_url`
    is (tests/conftest.py), for the same reason."""
    from tests.needs import smollm2_folder
    from tests.serve_process import serve_process

    with serve_process("--model-path", str(smollm2_folder()), "--max-total-tokens", "4096",
                       "--api-key", SMOL_API_KEY, "--quantization", "int8wo") as url:
        yield url


@pytest.fixture(scope="session")
def default_models_server() -> Iterator[str]:
    """`genserve serve --max-total-tokens 4096 --speculative-algorithm ngram` with no model
    argument (SmolLM2 and shapes-vl), started once for the modules that ask shapes-vl by name
    and for test_speculative_server's n-gram checks on SmolLM2 (shapes-vl, a default vision
    model, decodes plainly under the flag); yields its URL."""
    from tests.serve_process import serve_process

    with serve_process("--max-total-tokens", "4096", "--speculative-algorithm", "ngram") as url:
        yield url


KEYED_API_KEY = "s3cret-key"
KEYED_CORS_ORIGIN = "https://ui.example.com"
KEYED_SHUTDOWN_TIMEOUT_S = 6
KEYED_MODEL = "SmolLM2-135M-Instruct"


class ServerHolder:
    """A `genserve serve` subprocess (`serve_subprocess`), started on first use and again once
    a test has stopped it: `running()` gives (its process, its URL, its log file)."""

    def __init__(self, *flags: str) -> None:
        self.flags = flags
        self._stack: contextlib.ExitStack | None = None
        self._running: tuple[subprocess.Popen, str, IO[str]] | None = None

    def running(self) -> tuple[subprocess.Popen, str, IO[str]]:
        if self._running is None or self._running[0].poll() is not None:
            from tests.serve_process import serve_subprocess

            self.close()
            with contextlib.ExitStack() as stack:
                log = stack.enter_context(tempfile.TemporaryFile("w+"))
                proc, url = stack.enter_context(serve_subprocess(*self.flags, log=log))
                self._stack, self._running = stack.pop_all(), (proc, url, log)
        return self._running

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
        self._stack = self._running = None


@pytest.fixture(scope="session")
def keyed_server() -> Iterator[ServerHolder]:
    """`genserve serve --api-key KEYED_API_KEY` on the embedded SmolLM2 GGUF (also named
    KEYED_MODEL), shapes-vl (it takes image URLs) and tiny-flux, with `--cors-origin
    KEYED_CORS_ORIGIN`, loopback names allowed as image domains and a KEYED_SHUTDOWN_TIMEOUT_S
    drain. The security sweep (test_security_real_server) and the faults
    (test_serve_faults: kills, restarts, and SIGTERM at its end) share its start; a module
    asking for it after the SIGTERM gets a new one."""
    from tests.needs import smollm2_folder

    gguf = smollm2_folder() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    holder = ServerHolder(
        "--model-path", str(gguf), "--served-model-name", KEYED_MODEL,
        "--model-path", "shapes-vl", "--diffusion-model-path", "tiny-flux",
        "--api-key", KEYED_API_KEY, "--cors-origin", KEYED_CORS_ORIGIN,
        "--allowed-image-domains", "localhost,127.0.0.1,localtest.me",
        "--shutdown-timeout", str(KEYED_SHUTDOWN_TIMEOUT_S))
    try:
        yield holder
    finally:
        holder.close()
