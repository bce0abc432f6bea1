"""What one gateway app holds (no globals): its runtime clients, the serving object of every
endpoint family, the shared admission and the metrics.

Every endpoint family's router takes its serving object from here through a dependency
(`Depends(get_native_serving)`, `Depends(get_image_serving)` and their siblings); the ops routes
(/health, /v1/models, /metrics), which report on everything, take the state itself
(`Depends(get_state)`). All of them read `app.state.gateway`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import HTTPConnection

from genserve import envs
from genserve.entrypoints.admission import Admission
from genserve.entrypoints.anthropic_api.serving import MessagesServing
from genserve.entrypoints.config import GatewayConfig
from genserve.entrypoints.embeddings_api.serving import EmbeddingServing
from genserve.entrypoints.errors import model_not_found, service_unavailable
from genserve.entrypoints.images.serving import (
    IMAGE_STORE_MAX_AGE_S,
    IMAGE_STORE_MAX_BYTES,
    ImageServing,
)
from genserve.entrypoints.metrics import GatewayMetrics
from genserve.entrypoints.native.serving import NativeServing
from genserve.entrypoints.ollama_api.serving import OllamaServing
from genserve.entrypoints.openai_api.serving_chat import ChatServing
from genserve.entrypoints.openai_api.serving_completions import CompletionServing
from genserve.entrypoints.realtime.serving import RealtimeServing
from genserve.entrypoints.rerank_api.serving import RerankServing
from genserve.entrypoints.responses_api.serving import ResponsesServing
from genserve.entrypoints.videos.serving import (
    VIDEO_STORE_MAX_AGE_S,
    VIDEO_STORE_MAX_BYTES,
    VideoServing,
)
from genserve.multimodal_gen.client import DiffusionClient
from genserve.multimodal_gen.output_store import OutputStore
from genserve.srt.client import LLMEngineClient
from genserve.srt.multimodal.image_source import ImageFetchPolicy


@dataclass
class GatewayState:
    config: GatewayConfig
    llm_clients: list[LLMEngineClient]
    diffusion_client: DiffusionClient | None = None
    memory_plan: dict[str, Any] | None = None  # the server's memory plan (memory_planner.py)
    thread_split: dict[str, Any] | None = None  # the runtimes' torch threads (thread_split.py)
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    admission: Admission = field(init=False)
    # The LLM families' serving objects (answering 503 / 404 per request when no LLM serves).
    native: NativeServing = field(init=False)
    chat: ChatServing = field(init=False)
    completions: CompletionServing = field(init=False)
    messages: MessagesServing = field(init=False)  # Anthropic /v1/messages
    ollama: OllamaServing = field(init=False)  # the Ollama API under /api/
    responses: ResponsesServing = field(init=False)  # OpenAI /v1/responses and its store
    embeddings: EmbeddingServing = field(init=False)  # /v1/embeddings, pooled requests
    rerank: RerankServing = field(init=False)  # /v1/rerank
    # The diffusion families' serving objects; None when no diffusion model is served.
    images: ImageServing | None = field(init=False, default=None)
    videos: VideoServing | None = field(init=False, default=None)
    realtime: RealtimeServing | None = field(init=False, default=None)

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
        self.admission = Admission(self.config.max_queued_requests, self.metrics)
        self.native = NativeServing(self)
        self.chat = ChatServing(self)
        self.completions = CompletionServing(self)
        self.messages = MessagesServing(self)
        self.ollama = OllamaServing(self)
        self.responses = ResponsesServing(self)
        self.embeddings = EmbeddingServing(self)
        self.rerank = RerankServing(self)
        client = self.diffusion_client
        if client is not None:
            output_dir = envs.GENSERVE_OUTPUT_DIR.get()
            self.images = ImageServing(
                client, OutputStore(output_dir / "images", IMAGE_STORE_MAX_BYTES,
                                    IMAGE_STORE_MAX_AGE_S), self.admission, self.metrics)
            self.videos = VideoServing(
                client, OutputStore(output_dir / "videos", VIDEO_STORE_MAX_BYTES,
                                    VIDEO_STORE_MAX_AGE_S), self.admission, self.metrics,
                ImageFetchPolicy(self.config.allowed_image_domains,
                                 max_bytes=self.config.max_image_bytes))
            self.realtime = RealtimeServing(
                client, self.config.max_realtime_sessions, self.admission, self.metrics)

    @property
    def in_flight(self) -> dict[str, int]:
        """Model name -> requests admitted and not finished (the gateway's view of the queue)."""
        return self.admission.in_flight

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

    def resolve_llm_adapter(self, model: str | None) -> tuple[LLMEngineClient, str | None]:
        """(the LLM, its LoRA adapter or None) that an OpenAI `model` names: a served model,
        "BASE:ADAPTER", or an adapter's own name (the first LLM serving one of that name)."""
        if not model or model in self._by_name:
            return self.resolve_llm(model), None
        base, sep, adapter = model.partition(":")
        if sep and base in self._by_name:
            client = self._by_name[base]
            if adapter in client.lora_adapters():
                return client, adapter
        for client in self.llm_clients:
            if model in client.lora_adapters():
                return client, model
        names = self.llm_names() + [a for c in self.llm_clients for a in c.lora_adapters()]
        raise model_not_found(model, names)

    @contextmanager
    def admit(self, client: LLMEngineClient, count: int = 1) -> Iterator[None]:
        """Hold `count` queue slots of this LLM for the duration; 503 at once when full."""
        with self.admission.hold(client.model_name, client.is_healthy(), count):
            yield

    async def close(self) -> None:
        """Stop the work the serving objects run in the background (app shutdown)."""
        if self.videos is not None:
            await self.videos.close()
        if self.realtime is not None:
            self.realtime.close()


def get_state(conn: HTTPConnection) -> GatewayState:
    return conn.app.state.gateway


def get_native_serving(conn: HTTPConnection) -> NativeServing:
    return get_state(conn).native


def get_chat_serving(conn: HTTPConnection) -> ChatServing:
    return get_state(conn).chat


def get_completion_serving(conn: HTTPConnection) -> CompletionServing:
    return get_state(conn).completions


def _no_diffusion() -> Exception:
    return service_unavailable("No diffusion model is served by this server.", "no_diffusion")


def get_image_serving(conn: HTTPConnection) -> ImageServing:
    serving = get_state(conn).images
    if serving is None:
        raise _no_diffusion()
    return serving


def get_video_serving(conn: HTTPConnection) -> VideoServing:
    serving = get_state(conn).videos
    if serving is None:
        raise _no_diffusion()
    return serving


def get_realtime_serving(conn: HTTPConnection) -> RealtimeServing:
    serving = get_state(conn).realtime
    if serving is None:
        raise _no_diffusion()
    return serving


def get_messages_serving(conn: HTTPConnection) -> MessagesServing:
    return get_state(conn).messages


def get_ollama_serving(conn: HTTPConnection) -> OllamaServing:
    return get_state(conn).ollama


def get_responses_serving(conn: HTTPConnection) -> ResponsesServing:
    return get_state(conn).responses


def get_embedding_serving(conn: HTTPConnection) -> EmbeddingServing:
    return get_state(conn).embeddings


def get_rerank_serving(conn: HTTPConnection) -> RerankServing:
    return get_state(conn).rerank
