"""Running one diffusion request for an HTTP endpoint: model and size checks, admission,
metrics and the mapping of engine errors to HTTP errors. Images and videos both use it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from genserve.entrypoints.admission import Admission
from genserve.entrypoints.diffusion.params import step_cache_config
from genserve.entrypoints.errors import APIError, bad_request, model_not_found
from genserve.entrypoints.metrics import GatewayMetrics
from genserve.multimodal_gen.client import DiffusionClient
from genserve.multimodal_gen.messages import (
    IMAGE_EDIT,
    IMAGE_TO_VIDEO,
    INPAINTING,
    STATUS_BAD_INPUT,
    STATUS_CANCELLED,
    STATUS_UNKNOWN_MODEL,
    TEXT_TO_IMAGE,
    TEXT_TO_VIDEO,
    DiffusionEvent,
    DiffusionRequest,
    ErrorEvent,
    ModelSpec,
    ResultEvent,
    StepCacheConfig,
)
from genserve.multimodal_gen.validation import parse_size


def error_from_event(event: ErrorEvent) -> APIError:
    """The HTTP error of an engine ErrorEvent (its status is already an HTTP status)."""
    if event.status == STATUS_BAD_INPUT:
        return bad_request(event.message)
    if event.status == STATUS_UNKNOWN_MODEL:
        return APIError(404, event.message, code="model_not_found", param="model")
    if event.status == STATUS_CANCELLED:
        return APIError(499, event.message, type="request_cancelled")
    return APIError(event.status, event.message)


# The endpoint that serves each task.
TASK_ENDPOINTS = {
    TEXT_TO_IMAGE: "/v1/images/generations",
    IMAGE_EDIT: "/v1/images/edits",
    INPAINTING: "/v1/images/edits (with a mask)",
    TEXT_TO_VIDEO: "/v1/videos",
    IMAGE_TO_VIDEO: "/v1/videos (with an input_reference image)",
}


def resolve_model(client: DiffusionClient, model: str | None, tasks: str | tuple[str, ...],
                  endpoint: str) -> ModelSpec:
    """The spec of the requested model (or the first task's default); 404 unknown, 400 when
    the model's task is none of `tasks`."""
    tasks = (tasks,) if isinstance(tasks, str) else tasks
    if not model:
        model = next((m for t in tasks if (m := client.default_model(t))), None)
        if model is None:
            raise bad_request(f"this server has no {' or '.join(tasks)} model; pass `model`",
                              param="model")
    try:
        spec = client.model_spec(model)
    except KeyError:
        raise model_not_found(model, [s["id"] for s in client.list_models()]) from None
    if spec.task not in tasks:
        other = TASK_ENDPOINTS.get(spec.task, "another endpoint")
        raise bad_request(f"model {model!r} is a {spec.task} model; {endpoint} needs a "
                          f"{' or '.join(tasks)} model (use {other} for this one)",
                          param="model")
    return spec


def parse_size_param(size: str | None) -> tuple[int | None, int | None]:
    """(width, height) of a "WxH" size; (None, None) for none or "auto" (the model's default)."""
    if size is None or size == "auto":
        return None, None
    try:
        return parse_size(size)
    except ValueError as exc:
        raise bad_request(str(exc), param="size") from None


def request_step_cache(client: DiffusionClient, value: Any) -> StepCacheConfig | None:
    """The request's `step_cache` field over the server's step-cache settings."""
    return step_cache_config(value, client.default_step_cache)


class DiffusionRun:
    """One diffusion request on behalf of an HTTP request.

    Creating it takes the model's admission slot (503 at once when the queue is full or the
    worker is down); `events()` streams the engine's events and records the request's metrics
    as it ends; `close()` (idempotent, also run when `events()` ends) gives the slot back.
    """

    def __init__(self, client: DiffusionClient, admission: Admission, metrics: GatewayMetrics,
                 req: DiffusionRequest) -> None:
        task = client.model_spec(req.model).task  # the endpoint resolved the model already
        admission.acquire(req.model, client.is_healthy())
        self.task = task
        self.client = client
        self.admission = admission
        self.metrics = metrics
        self.req = req
        self._start = time.perf_counter()
        self._closed = False
        self._reason = "abort"  # until an event says how it ended

    async def events(self) -> AsyncIterator[DiffusionEvent]:
        try:
            async with contextlib.aclosing(self.client.stream(self.req)) as stream:
                async for event in stream:
                    if isinstance(event, ResultEvent):
                        self._reason = "completed"
                        self.metrics.observe_diffusion_result(self.req.model, self.task, event)
                    elif isinstance(event, ErrorEvent):
                        self._reason = ("cancelled" if event.status == STATUS_CANCELLED
                                        else "error")
                    yield event
        finally:
            self.close()

    async def result(self) -> ResultEvent:
        """Run to the end; the engine's ErrorEvent becomes the matching APIError."""
        async with contextlib.aclosing(self.events()) as events:
            async for event in events:
                if isinstance(event, ResultEvent):
                    return event
                if isinstance(event, ErrorEvent):
                    raise error_from_event(event)
        raise APIError(503, "the diffusion engine ended the request without a result")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.admission.release(self.req.model)
        self.metrics.request_finished(self.req.model, self._reason,
                                      time.perf_counter() - self._start)
