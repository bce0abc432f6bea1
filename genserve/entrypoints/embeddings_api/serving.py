"""/v1/embeddings, and the pooled-request path every pooling endpoint shares: resolve a model by
its task, hold admission slots, run one `EmbedRequest` per input concurrently (they batch in the
scheduler) and count them in the metrics."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import Request

from genserve.entrypoints.admission import new_rid
from genserve.entrypoints.errors import APIError, bad_request, service_unavailable
from genserve.srt.client import LLMEngineClient
from genserve.srt.messages import EmbedOutput, EmbedRequest

from .protocol import EmbeddingRequest

if TYPE_CHECKING:
    from genserve.entrypoints.state import GatewayState

_TASK_NAMES = {"embed": "an embedding model", "rerank": "a reranker",
               "generate": "a generative (chat) model"}
_TASK_ROUTES = {"embed": "/v1/embeddings", "rerank": "/v1/rerank",
                "generate": "/v1/chat/completions"}


class EmbeddingServing:
    """The pooled requests of one app (`GatewayState.embeddings`)."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    def resolve(self, model: str | None, task: str) -> LLMEngineClient:
        """The client serving `model`, which must be a `task` model (400 naming what it is
        otherwise); without a model, the first one of that task."""
        if not model:
            for client in self.state.llm_clients:
                if client.task == task:
                    return client
            # A client error, not an outage: this server will never serve one (start it with
            # an embedding or reranker --model-path).
            raise bad_request(f"No {_TASK_NAMES[task].split(' ', 1)[1]} is served by this "
                              "server.", "model", f"no_{task}_model")
        client = self.state.resolve_llm(model)
        if client.task != task:
            raise bad_request(
                f"model {model!r} is {_TASK_NAMES.get(client.task, client.task)}, not "
                f"{_TASK_NAMES[task]}; it serves {_TASK_ROUTES.get(client.task, '')}",
                "model", "wrong_model_task")
        return client

    async def run(self, client: LLMEngineClient, inputs: list[tuple[list[int], list[int] | None]],
                  dimensions: int | None = None) -> list[EmbedOutput]:
        """Pool every (input_ids, token_type_ids) input; outputs in input order."""
        if not inputs:
            raise bad_request("the input is empty: send at least one text", "input")
        start = time.monotonic()
        reqs = [EmbedRequest(new_rid("embd-"), ids, types, dimensions) for ids, types in inputs]
        with self.state.admit(client, len(reqs)):
            try:
                outs = await asyncio.gather(*(client.embed(r) for r in reqs))
            except APIError:
                raise
            except ValueError as exc:
                raise bad_request(str(exc), "input") from exc
            except Exception as exc:
                if not client.is_healthy():
                    raise service_unavailable(f"The engine serving {client.model_name!r} "
                                              f"stopped: {exc}", "engine_dead") from exc
                raise APIError(500, f"The engine serving {client.model_name!r} failed: "
                                    f"{exc}") from exc
        metrics, name = self.state.metrics, client.model_name
        for out in outs:
            if out.error is not None:
                metrics.request_finished(name, "error", time.monotonic() - start)
                raise APIError(out.error_status, out.error)
        for out in outs:
            metrics.request_finished(name, "stop", time.monotonic() - start)
            metrics.count_tokens(name, out.prompt_tokens, 0, out.cached_tokens)
        return list(outs)

    def tokenize(self, client: LLMEngineClient, body_input: Any, prompt_name: str | None,
                 instruction: str | None) -> list[list[int]]:
        """Token ids of each input (text tokenized with the model's prompt; ids as given)."""
        items = [body_input] if isinstance(body_input, str) else list(body_input)
        if items and all(isinstance(x, int) for x in items):
            items = [items]  # one input given as token ids
        if not items:
            raise bad_request("'input' is empty: send a string or a non-empty list", "input")
        out = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise bad_request("'input' holds an empty string", "input")
                try:
                    out.append(client.embedding_input(item, prompt_name, instruction))
                except ValueError as exc:
                    raise bad_request(str(exc), "input") from exc
            else:
                out.append(list(item))
        return out

    async def create_embedding(self, body: EmbeddingRequest, request: Request
                               ) -> dict[str, Any]:
        client = self.resolve(body.model, "embed")
        ids = self.tokenize(client, body.input, body.prompt_name, body.instruction)
        outs = await self.run(client, [(x, None) for x in ids], body.dimensions)
        data = [{"object": "embedding", "index": i,
                 "embedding": _encode(out.embedding, body.encoding_format)}
                for i, out in enumerate(outs)]
        tokens = sum(out.prompt_tokens for out in outs)
        return {"object": "list", "data": data, "model": body.model or client.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
