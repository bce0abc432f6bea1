"""The gateway in front of the real runtime (embedded SmolLM2-135M-Instruct) and, optionally, a
diffusion worker, as `genserve serve` starts them, on one event loop in a background thread."""

from __future__ import annotations

import asyncio
from typing import Any

from genserve.bench.gateway_thread import GatewayThread
from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from genserve.entrypoints.serve import import_async_engine
from genserve.srt.server_args import EngineArgs

AsyncEngine = import_async_engine()


class RealServer(GatewayThread):
    """Engine + gateway + uvicorn in a background thread; with `diffusion_models`, a diffusion
    worker serving them too."""

    def __init__(self, diffusion_models: tuple[str, ...] = ()) -> None:
        self.diffusion_models = diffusion_models
        super().__init__(self._app)

    async def _app(self, runtimes: list[Any]) -> Any:
        # float32: greedy outputs must not depend on batch composition (bf16 rounding can).
        engine = AsyncEngine(EngineArgs(max_total_tokens=4096, dtype="float32"))
        runtimes.append(engine)
        diffusion = None
        if self.diffusion_models:
            from genserve.multimodal_gen.engine_client import WorkerDiffusionClient
            from genserve.multimodal_gen.worker import WorkerConfig

            diffusion = await asyncio.to_thread(
                WorkerDiffusionClient, WorkerConfig(self.diffusion_models, num_threads=1)
            )
            runtimes.append(diffusion)
        return create_app(GatewayConfig(max_queued_requests=256), [engine], diffusion)
