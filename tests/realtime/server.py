"""Run an ASGI app under a real uvicorn server on 127.0.0.1 (a free port) in a thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

from tests.serve_process import free_port


@contextlib.contextmanager
def serve(app, port: int | None = None, timeout_s: float = 20.0) -> Iterator[str]:
    """Yields the base URL (`http://127.0.0.1:PORT`) while the server runs."""
    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
