"""The interface the gateway (REST routers, realtime WebSocket) uses to talk to the diffusion
engine. No torch here: the real engine runs its pipelines in a worker process
(`genserve.multimodal_gen.engine_client.WorkerDiffusionClient`).

`DiffusionClient` is the interface as the gateway sees it (a Protocol: the gateway types every
client by it); `DiffusionEngineClient` is the base implementations inherit, which derives the
model queries from `specs()`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, Protocol

from genserve.multimodal_gen.messages import (
    DiffusionRequest,
    ErrorEvent,
    ModelSpec,
    ResultEvent,
    StepCacheConfig,
    StepEvent,
)


class DiffusionClient(Protocol):
    """What the gateway calls on a diffusion runtime, all from its event loop."""

    # The server's step-cache settings; a request's `step_cache` overrides fields of it.
    default_step_cache: StepCacheConfig

    def specs(self) -> list[ModelSpec]: ...

    def list_models(self) -> list[dict[str, Any]]: ...

    def model_spec(self, model: str) -> ModelSpec: ...

    def default_model(self, task: str) -> str | None: ...

    def stream(self, req: DiffusionRequest
               ) -> AsyncIterator[StepEvent | ResultEvent | ErrorEvent]: ...

    async def cancel(self, rid: str) -> bool: ...

    async def end_stream(self, stream_id: str) -> None: ...

    def stream_stats(self) -> dict[str, int]: ...

    def is_healthy(self) -> bool: ...

    def runtime_report(self) -> dict[str, Any]: ...

    def queue_depth(self) -> int: ...

    async def shutdown(self) -> None: ...


class DiffusionEngineClient(ABC):
    """Diffusion models served by the gateway. All methods are called from the gateway's event
    loop. `specs()` is the only abstract model query; the others derive from it."""

    default_step_cache: StepCacheConfig = StepCacheConfig()

    @abstractmethod
    def specs(self) -> list[ModelSpec]:
        """Every served model, in the order they were given (the first of a task is its default)."""

    def list_models(self) -> list[dict[str, Any]]:
        """The /v1/models entries (`kind: "diffusion"`, `task`, `default_size`, ...)."""
        return [spec.to_model_card() for spec in self.specs()]

    def model_spec(self, model: str) -> ModelSpec:
        """The spec of `model`; raises KeyError for a model that is not served."""
        for spec in self.specs():
            if spec.name == model:
                return spec
        raise KeyError(model)

    def default_model(self, task: str) -> str | None:
        """The first served model of `task` ("text-to-image" | "text-to-video"), or None."""
        for spec in self.specs():
            if spec.task == task:
                return spec.name
        return None

    @abstractmethod
    def stream(self, req: DiffusionRequest) -> AsyncIterator[StepEvent | ResultEvent | ErrorEvent]:
        """Run `req`; yields its events in order and ends after one ResultEvent or ErrorEvent.

        Bad input (unknown model, size/frames/steps the model cannot take) yields a single
        ErrorEvent (404 / 400) without reaching the worker. Closing the iterator early (`aclose`)
        cancels the request: the worker stops at the next step and frees its slot."""

    @abstractmethod
    async def cancel(self, rid: str) -> bool:
        """Cancel a queued or running request (its stream ends with ErrorEvent(499)); False if
        the id is unknown or already finished."""

    async def end_stream(self, stream_id: str) -> None:
        """Free the state a streaming model keeps for `stream_id` between chunks (a no-op when
        none is held). Sessions call it when they stop, restart or go away. Engines that
        serve no streaming model hold nothing to free."""
        return None

    def stream_stats(self) -> dict[str, int]:
        """Streaming sessions held by the engine: `streams` and their `stream_bytes`."""
        return {"streams": 0, "stream_bytes": 0}

    def runtime_report(self) -> dict[str, Any]:
        """The worker process as /health shows it: `state` (starting | ready | restarting |
        stopped), and where known its `pid` and number of `restarts`."""
        return {"state": "ready" if self.is_healthy() else "stopped"}

    def memory_reports(self) -> list[dict[str, Any]]:
        """What the server's memory plan needs of each worker once its models are loaded
        (multimodal_gen/memory_report.py): its device and each model's weights and peak.
        Engines that hold no device memory report nothing."""
        return []

    @abstractmethod
    def is_healthy(self) -> bool:
        """False once the worker process has died."""

    @abstractmethod
    def queue_depth(self) -> int:
        """Requests submitted and not finished (queued or running)."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the worker process; in-flight streams end with ErrorEvent(503)."""
