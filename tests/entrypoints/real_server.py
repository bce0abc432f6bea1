"""The gateway in front of the real runtime (embedded SmolLM2-135M-Instruct) and, optionally, a
diffusion worker, as `genserve serve` starts them, on one event loop in a background thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from genserve.entrypoints.serve import import_async_engine
from genserve.srt.server_args import EngineArgs

AsyncEngine = import_async_engine()


class RealServer:
    """Runs engine + gateway + uvicorn on one event loop in a background thread; with
    `diffusion_models`, a diffusion worker serving them too."""

    def __init__(self, diffusion_models: tuple[str, ...] = ()) -> None:
        self.diffusion_models = diffusion_models
        self.url = ""
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._server: Any = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        import uvicorn

        engine = diffusion = None
        try:
            # float32: greedy outputs must not depend on batch composition (bf16 rounding can).
            engine = AsyncEngine(EngineArgs(max_total_tokens=4096, dtype="float32"))
            if self.diffusion_models:
                from genserve.multimodal_gen.engine_client import WorkerDiffusionClient
                from genserve.multimodal_gen.worker import WorkerConfig

                diffusion = await asyncio.to_thread(
                    WorkerDiffusionClient, WorkerConfig(self.diffusion_models, num_threads=1))
            app = create_app(GatewayConfig(max_queued_requests=256), [engine], diffusion)

            class Server(uvicorn.Server):
                def install_signal_handlers(self) -> None:
                    pass

            self._server = Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                 log_level="warning", lifespan="off"))
            task = asyncio.create_task(self._server.serve())
            while not self._server.started:
                if task.done():
                    await task
                await asyncio.sleep(0.02)
            port = self._server.servers[0].sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            self._ready.set()
            await task
        except BaseException as exc:
            self.error = exc
            self._ready.set()
        finally:
            if engine is not None:
                await engine.shutdown()
            if diffusion is not None:
                await diffusion.shutdown()

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(300)
        if self.error is not None:
            raise RuntimeError(f"server failed to start: {self.error!r}")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(60)
