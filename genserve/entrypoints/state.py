"""What one gateway app holds: its clients, metrics and admission counters (no globals)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from genserve.entrypoints.config import GatewayConfig
from genserve.entrypoints.errors import model_not_found, service_unavailable
from genserve.entrypoints.metrics import GatewayMetrics
from genserve.srt.client import LLMEngineClient


@dataclass
class GatewayState:
    config: GatewayConfig
    llm_clients: list[LLMEngineClient]
    diffusion_client: Any | None = None
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    # model name -> requests admitted and not finished (the gateway's view of the queue)
    in_flight: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_name: dict[str, LLMEngineClient] = {}
        for client in self.llm_clients:
            if client.model_name in self._by_name:
                raise ValueError(f"two LLMs are served under the same name {client.model_name!r}")
            self._by_name[client.model_name] = client
        if self.config.served_model_names and not self.llm_clients:
            raise ValueError("served_model_names given but no LLM is served")
        for alias in self.config.served_model_names:
            self._by_name.setdefault(alias, self.llm_clients[0])

    def llm_names(self) -> list[str]:
        return list(self._by_name)

    def resolve_llm(self, model: str | None) -> LLMEngineClient:
        """The LLM serving `model`; the first one when `model` is empty (native API). 404 else."""
        if not model:
            if not self.llm_clients:
                raise service_unavailable("No LLM is served by this server.", "no_llm")
            return self.llm_clients[0]
        client = self._by_name.get(model)
        if client is None:
            raise model_not_found(model, self.llm_names())
        return client

    @contextmanager
    def admit(self, client: LLMEngineClient, count: int = 1) -> Iterator[None]:
        """Hold `count` queue slots for the duration; 503 at once when the queue is full."""
        name = client.model_name
        if not client.is_healthy():
            self.metrics.rejected.inc(count, name, "503")
            raise service_unavailable(
                f"The engine serving {name!r} is not running.", "engine_dead")
        limit = self.config.max_queued_requests
        current = self.in_flight.get(name, 0)
        if limit is not None and current + count > limit:
            self.metrics.rejected.inc(count, name, "503")
            raise service_unavailable(
                f"Server busy: {current} requests are queued for {name!r} "
                f"(limit {limit}); retry later.", "queue_full")
        self.in_flight[name] = current + count
        self.metrics.in_flight.set(current + count, name)
        try:
            yield
        finally:
            self.in_flight[name] -= count
            self.metrics.in_flight.set(self.in_flight[name], name)


def get_state(request: Request) -> GatewayState:
    return request.app.state.gateway
