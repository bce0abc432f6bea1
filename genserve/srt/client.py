"""The interface the HTTP gateway uses to talk to an LLM runtime. No torch here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from genserve.srt.messages import (
    EmbedOutput,
    EmbedRequest,
    GenerateOutput,
    GenerateRequest,
    MultimodalInputs,
)


class LLMEngineClient(ABC):
    """An LLM served by the gateway. Implemented by the real runtime (`genserve.srt.engine`)
    and by test fakes. All methods are called from the gateway's event loop."""

    model_name: str  # id shown in /v1/models
    context_length: int  # max prompt + output tokens
    # Input kinds it takes; vision-language models add "image" (GenerateRequest.images).
    modalities: tuple[str, ...] = ("text",)
    # What it serves: "generate" (chat, completions), "embed" (an embedder) or "rerank" (a
    # cross-encoder); embedders and rerankers answer `embed` only.
    task: str = "generate"

    async def embed(self, req: EmbedRequest) -> EmbedOutput:
        """The pooled vector of one input (a reranker: its score). ValueError for invalid input
        (empty, longer than the context, unsupported `dimensions`, not an embedding model)."""
        raise ValueError(f"model {self.model_name!r} is a generative model: it serves no "
                         "embeddings")

    def embedding_input(self, text: str, prompt_name: str | None = None,
                        prompt: str | None = None) -> list[int]:
        """Token ids of one embedding input, with the model's instruction prompt (named, given,
        or the model's default) before it."""
        raise ValueError(f"model {self.model_name!r} is a generative model: it serves no "
                         "embeddings")

    def rerank_input(self, query: str, document: str) -> tuple[list[int], list[int] | None]:
        """(input_ids, token_type_ids) of one (query, document) pair of a reranker."""
        raise ValueError(f"model {self.model_name!r} is not a reranker")

    @abstractmethod
    def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Run one request (n == 1). Yields outputs as tokens arrive (every step when
        `req.stream`, else only the final one); the last has `finished=True`. Raises ValueError
        for invalid input (bad sampling params, prompt too long) before yielding anything.
        Closing the iterator early (client gone) aborts the request and frees its KV."""

    async def process_images(self, input_ids: list[int], images: list[bytes]
                             ) -> tuple[list[int], MultimodalInputs]:
        """Preprocess encoded image files for a prompt with one placeholder per image:
        returns the ids with each placeholder expanded to the image's token count, and the
        `mm_inputs` to put in the GenerateRequest. ValueError names a bad image or count."""
        raise ValueError(f"model {self.model_name!r} does not take image inputs")

    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters requests may select, name -> path (none by default)."""
        return {}

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, str]:
        """Load a PEFT adapter folder under `lora_name`; returns the adapters then loaded.
        ValueError (a 400) names why it cannot (unknown folder, a mismatch with the model)."""
        raise ValueError(f"model {self.model_name!r} does not serve LoRA adapters")

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, str]:
        """Forget an adapter; ValueError when it is unknown or requests use it."""
        raise ValueError(f"model {self.model_name!r} does not serve LoRA adapters")

    @abstractmethod
    async def abort(self, rid: str) -> bool:
        """Abort a running or queued request; False if it is unknown."""

    @abstractmethod
    async def flush_cache(self) -> bool:
        """Drop the prefix cache; False (and nothing done) while requests are running."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` with the model's tokenizer (adds BOS as the model expects)."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`, with or without the tokenizer's special tokens (/tokenize).
        Default: `tokenize`, which adds them as the model expects."""
        return self.tokenize(text)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (for logprob token strings). Default: ids shown as numbers."""
        return "".join(f"token_id:{i}" for i in ids)

    @abstractmethod
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render OpenAI-style chat messages (and `tools`, when the template renders them)
        with the tokenizer's chat template."""

    @abstractmethod
    def model_info(self) -> dict[str, Any]:
        """Static facts: model_path, architecture, dtype, context length, vocab size."""

    @abstractmethod
    async def server_info(self) -> dict[str, Any]:
        """Live facts: KV pool size/usage, cache stats, running/waiting requests, integrity."""

    def runtime_report(self) -> dict[str, Any]:
        """The scheduler process as /health shows it: `state` (starting | ready | restarting |
        stopped), and where known its `pid` and number of `restarts`."""
        return {"state": "ready" if self.is_healthy() else "stopped"}

    @abstractmethod
    def is_healthy(self) -> bool:
        """False once the scheduler process has died."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the runtime's processes."""
