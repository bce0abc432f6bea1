"""Logic behind /health, /v1/models and /metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from genserve.entrypoints.state import GatewayState

logger = logging.getLogger(__name__)

_SERVER_INFO_TIMEOUT_S = 2.0


def health(state: GatewayState) -> tuple[bool, dict[str, Any], dict[str, Any]]:
    """(all healthy, per-component up/down, per-component runtime process report: state
    starting | ready | restarting | stopped, pid, restarts)."""
    report: dict[str, Any] = {c.model_name: c.is_healthy() for c in state.llm_clients}
    runtimes: dict[str, Any] = {c.model_name: c.runtime_report() for c in state.llm_clients}
    if state.diffusion_client is not None:
        report["diffusion"] = state.diffusion_client.is_healthy()
        runtimes["diffusion"] = state.diffusion_client.runtime_report()
    return all(report.values()), report, runtimes


def list_models(state: GatewayState) -> dict[str, Any]:
    created = int(time.time())
    data: list[dict[str, Any]] = []
    for name in state.llm_names():
        client = state.resolve_llm(name)
        data.append({
            "id": name, "object": "model", "created": created, "owned_by": "genserve",
            "kind": "llm", "root": client.model_name, "max_model_len": client.context_length,
            "modalities": list(client.modalities),
        })
        if name != client.model_name:
            continue  # an alias: its adapters are listed under the model's own name
        for adapter in client.lora_adapters():  # selected by `model: "ADAPTER"`
            data.append({
                "id": adapter, "object": "model", "created": created, "owned_by": "genserve",
                "kind": "llm", "root": adapter, "parent": name,
                "max_model_len": client.context_length, "modalities": list(client.modalities),
            })
    if state.diffusion_client is not None:
        for entry in state.diffusion_client.list_models():
            item = {"object": "model", "created": created, "owned_by": "genserve"}
            item.update(entry)
            data.append(item)
    return {"object": "list", "data": data}


async def render_metrics(state: GatewayState) -> bytes:
    """Refresh the engine gauges from each client's server_info, then render everything."""
    for client in state.llm_clients:
        if not client.is_healthy():
            continue
        try:
            info = await asyncio.wait_for(client.server_info(), _SERVER_INFO_TIMEOUT_S)
        except Exception as exc:  # a slow or dead engine must not break scraping
            logger.warning("server_info failed for %s: %s", client.model_name, exc)
            continue
        state.metrics.update_server_info(client.model_name, info)
    diffusion = state.diffusion_client
    if diffusion is not None and diffusion.is_healthy():
        state.metrics.diffusion_queue_depth.set(diffusion.queue_depth())
        streams = diffusion.stream_stats()
        state.metrics.diffusion_streams.set(streams["streams"])
        state.metrics.diffusion_stream_bytes.set(streams["stream_bytes"])
    return state.metrics.render()
