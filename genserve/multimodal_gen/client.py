"""The interface the gateway (REST routers, realtime WebSocket) uses to talk to the diffusion
engine. No torch here: the real engine runs its pipelines in a worker process
(`genserve.multimodal_gen.engine_client.WorkerDiffusionClient`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from genserve.multimodal_gen.messages import (
    DiffusionRequest,
    ErrorEvent,
    ModelSpec,
    ResultEvent,
    StepEvent,
)


class DiffusionEngineClient(ABC):
    """Diffusion models served by the gateway. All methods are called from the gateway's event
    loop. `specs()` is the only abstract model query; the others derive from it."""

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
    async def cancel(self, request_id: str) -> bool:
        """Cancel a queued or running request (its stream ends with ErrorEvent(499)); False if
        the id is unknown or already finished."""

    @abstractmethod
    def is_healthy(self) -> bool:
        """False once the worker process has died."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the worker process; in-flight streams end with ErrorEvent(503)."""
