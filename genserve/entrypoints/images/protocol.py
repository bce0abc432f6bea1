"""Request models of the OpenAI-shaped image endpoints."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from genserve.entrypoints.diffusion.params import DiffusionParams


class _ImageParams(DiffusionParams):
    n: int = Field(default=1, ge=1, le=8)
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100)  # jpeg/webp quality
    # Server-sent events: `partial_images` previews of the denoising, then the final image.
    stream: bool = False
    partial_images: int = Field(default=0, ge=0, le=3)
    # OpenAI fields this server accepts and ignores (a diffusion model has no such knobs).
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    moderation: str | None = None


class ImageGenerationRequest(_ImageParams):
    """POST /v1/images/generations (JSON)."""


class ImageEditRequest(_ImageParams):
    """POST /v1/images/edits (multipart; the image travels as a file field)."""

    strength: float | None = Field(default=None, gt=0.0, le=1.0)
    input_fidelity: str | None = None
