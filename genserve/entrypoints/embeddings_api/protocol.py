"""Request shape of OpenAI's /v1/embeddings, with sentence-transformers' prompt choice as
extensions (`prompt_name`, `instruction`). Unknown fields are tolerated."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from genserve.entrypoints.lenient import LenientModel


class EmbeddingRequest(LenientModel):
    model: str | None = None  # None: the first embedding model served
    # A string, a list of strings, a list of token ids or a list of token-id lists.
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)  # Matryoshka models only
    user: str | None = None
    # The model's named instruction prompt (config_sentence_transformers.json "prompts"), or a
    # literal one put before every input; else the model's default prompt, if it has one.
    prompt_name: str | None = None
    instruction: str | None = None
