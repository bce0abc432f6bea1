"""The gateway on a real uvicorn server, on its own event loop in a background thread, for the
benchmarks and tests that drive `genserve serve`'s HTTP stack in-process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

# Builds the app on the thread's event loop; every runtime it starts goes into the list it is
# given (before anything else can fail), and is shut down when the server stops.
AppBuilder = Callable[[list[Any]], Awaitable[Any]]


class GatewayThread:
    """`start()` returns once uvicorn listens on a free loopback port (`url`); `stop()` ends the
    server and shuts the runtimes down. Also a context manager."""

    def __init__(self, build: AppBuilder) -> None:
        self._build = build
        self.url = ""
        self.error: BaseException | None = None
        self._server: Any = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        import uvicorn

        runtimes: list[Any] = []
        try:
            app = await self._build(runtimes)
            self._server = uvicorn.Server(
                uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
            )
            self._server.install_signal_handlers = lambda: None
            task = asyncio.create_task(self._server.serve())
            while not self._server.started:
                if task.done():
                    await task  # raises what stopped uvicorn from starting
                await asyncio.sleep(0.02)
            port = self._server.servers[0].sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            self._ready.set()
            await task
        except BaseException as exc:
            self.error = exc
            self._ready.set()
        finally:
            for runtime in reversed(runtimes):
                await runtime.shutdown()

    def start(self, timeout: float = 300) -> GatewayThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"gateway not up after {timeout:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"gateway failed to start: {self.error!r}")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(60)

    def __enter__(self) -> GatewayThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
