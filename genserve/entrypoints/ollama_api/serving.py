"""The Ollama API over the gateway's LLMs: chat and generate (NDJSON streams by default, as
Ollama does, or one JSON body), with Ollama's timing fields, and the model listings."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from genserve import __version__
from genserve.entrypoints.errors import APIError
from genserve.entrypoints.generation import GenerationGroup, primed
from genserve.entrypoints.openai_api.reasoning import ReasoningStreamer
from genserve.entrypoints.openai_api.serving_chat import PreparedChat
from genserve.entrypoints.openai_api.tool_calls import ToolCallStreamer
from genserve.srt.client import LLMEngineClient
from genserve.srt.messages import GenerateOutput

from .protocol import ChatRequest, Common, EmbedRequest, GenerateRequest
from .translate import chat_to_chat, generate_to_chat, served_name

if TYPE_CHECKING:
    from genserve.entrypoints.state import GatewayState


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class _Timing:
    """Ollama's durations (nanoseconds): total, prompt evaluation (to the first token) and
    generation (first token to the end)."""

    def __init__(self) -> None:
        self.start = time.monotonic_ns()
        self.first: int | None = None

    def seen(self) -> None:
        if self.first is None:
            self.first = time.monotonic_ns()

    def fields(self, out: GenerateOutput) -> dict[str, Any]:
        end = time.monotonic_ns()
        first = self.first or end
        return {"total_duration": end - self.start, "load_duration": 0,
                "prompt_eval_count": out.prompt_tokens, "prompt_eval_duration": first - self.start,
                "eval_count": out.completion_tokens, "eval_duration": end - first}


def _done_reason(out: GenerateOutput) -> str:
    return "length" if (out.finish_reason or {}).get("type") == "length" else "stop"


def _split(prep: PreparedChat, text: str) -> tuple[str | None, str, list[dict[str, Any]]]:
    """(thinking, content, Ollama tool_calls) of a finished output."""
    thought = None
    if prep.reasoning is not None:
        thought, text = prep.reasoning.split(text)
    calls: list[dict[str, Any]] = []
    if prep.plan is not None:
        content, parsed = prep.plan.parser.parse(text)
        text = content or ""
        calls = [{"function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                 for c in parsed]
    return thought, text, calls


def _piece(chat: bool, text: str, thought: str | None, calls: list[dict[str, Any]]
           ) -> dict[str, Any]:
    if not chat:
        piece: dict[str, Any] = {"response": text}
        if thought:
            piece["thinking"] = thought
        return piece
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thought:
        message["thinking"] = thought
    if calls:
        message["tool_calls"] = calls
    return {"message": message}


def _details(client: LLMEngineClient) -> dict[str, Any]:
    info = client.model_info()
    arch = str(info.get("architecture") or "unknown")
    return {"parent_model": "", "format": "safetensors", "family": arch, "families": [arch],
            "parameter_size": "", "quantization_level": str(info.get("dtype") or "")}


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


class OllamaServing:
    """The Ollama API's endpoints (one per app, `GatewayState`)."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    def _model(self, model: str) -> str:
        return served_name(model, self.state.llm_names())

    async def chat(self, body: ChatRequest, request: Request) -> Response:
        model = self._model(body.model)
        if not body.messages:  # Ollama's way to load a model: answer at once
            self.state.resolve_llm(model)
            return JSONResponse({"model": body.model, "created_at": _now(), "message": {
                "role": "assistant", "content": ""}, "done": True, "done_reason": "load"})
        return await self._run(body, True, chat_to_chat(body, model), request)

    async def generate(self, body: GenerateRequest, request: Request) -> Response:
        model = self._model(body.model)
        if not body.prompt and not body.images:
            self.state.resolve_llm(model)
            return JSONResponse({"model": body.model, "created_at": _now(), "response": "",
                                 "done": True, "done_reason": "load"})
        return await self._run(body, False, generate_to_chat(body, model), request)

    async def _run(self, body: Common, chat: bool, chat_body: Any, request: Request
                   ) -> Response:
        timing = _Timing()
        prep = await self.state.chat.prepare(chat_body)
        group = GenerationGroup(self.state, prep.client, prep.reqs, request)
        await group.__aenter__()
        try:
            if not body.stream:
                last: GenerateOutput | None = None
                async for out in group.stream(0):
                    timing.seen()
                    last = out
                await group.close()
                if last is None:
                    raise APIError(500, "The engine ended the request without a result.")
                thought, text, calls = _split(prep, last.text)
                return JSONResponse({"model": body.model, "created_at": _now(),
                                     **_piece(chat, text, thought, calls), "done": True,
                                     "done_reason": _done_reason(last), **timing.fields(last)})
            outs = await primed(group.stream(0))
        except BaseException:
            await group.close()
            raise
        return StreamingResponse(
            self._lines(body, chat, prep, group, outs, timing),
            media_type="application/x-ndjson", background=BackgroundTask(group.close))

    async def _lines(self, body: Common, chat: bool, prep: PreparedChat, group: GenerationGroup,
                     outs: AsyncIterator[GenerateOutput], timing: _Timing
                     ) -> AsyncIterator[bytes]:
        thinker = ReasoningStreamer(prep.reasoning) if prep.reasoning else None
        streamer = ToolCallStreamer(prep.plan.parser) if prep.plan else None
        sent = 0

        def line(payload: dict[str, Any]) -> bytes:
            return json.dumps(payload, ensure_ascii=False).encode() + b"\n"

        try:
            async for out in outs:
                timing.seen()
                text, thought = out.text, ""
                if thinker is not None:
                    thought, text = thinker.update(out.text, out.finished)
                if streamer is not None:
                    delta, _ = streamer.update(text, out.finished)
                else:
                    delta, sent = text[sent:], max(sent, len(text))
                calls = _split(prep, out.text)[2] if out.finished else []
                if delta or thought or not out.finished:
                    if delta or thought:
                        yield line({"model": body.model, "created_at": _now(),
                                    **_piece(chat, delta, thought or None, []), "done": False})
                    if not out.finished:
                        continue
                yield line({"model": body.model, "created_at": _now(),
                            **_piece(chat, "", None, calls), "done": True,
                            "done_reason": _done_reason(out), **timing.fields(out)})
        except APIError as exc:
            yield line({"error": exc.message})
        finally:
            await group.close()

    async def embed(self, body: EmbedRequest) -> dict[str, Any]:
        """/api/embed: one vector per input, through the shared pooled-request path."""
        start = time.monotonic_ns()
        pooled = self.state.embeddings
        client = pooled.resolve(self._model(body.model), "embed")
        ids = pooled.tokenize(client, body.input, None, None)
        if body.truncate:
            ids = [x[: client.context_length] for x in ids]
        outs = await pooled.run(client, [(x, None) for x in ids], body.dimensions)
        return {"model": body.model, "embeddings": [out.embedding for out in outs],
                "total_duration": time.monotonic_ns() - start, "load_duration": 0,
                "prompt_eval_count": sum(out.prompt_tokens for out in outs)}

    def tags(self) -> dict[str, Any]:
        models = []
        for name in self.state.llm_names():
            client = self.state.resolve_llm(name)
            models.append({"name": name, "model": name, "modified_at": _now(), "size": 0,
                           "digest": _digest(name), "details": _details(client)})
        return {"models": models}

    def show(self, model: str) -> dict[str, Any]:
        client = self.state.resolve_llm(self._model(model))
        info = client.model_info()
        arch = str(info.get("architecture") or "unknown")
        capabilities = ["completion", "tools"]
        if "image" in client.modalities:
            capabilities.append("vision")
        return {"modelfile": "", "parameters": "", "template": "", "details": _details(client),
                "model_info": {"general.architecture": arch,
                               f"{arch}.context_length": client.context_length},
                "capabilities": capabilities, "modified_at": _now()}

    def ps(self) -> dict[str, Any]:
        expires = (datetime.now(UTC) + timedelta(days=3650)).isoformat().replace("+00:00", "Z")
        models = []
        for name in self.state.llm_names():
            client = self.state.resolve_llm(name)
            models.append({"name": name, "model": name, "size": 0, "digest": _digest(name),
                           "details": _details(client), "expires_at": expires, "size_vram": 0,
                           "context_length": client.context_length})
        return {"models": models}

    @staticmethod
    def version() -> dict[str, Any]:
        return {"version": __version__}
