"""Request/response models of the OpenAI (Sora) shaped video job API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from genserve.entrypoints.diffusion.params import DiffusionParams

QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED = (
    "queued", "in_progress", "completed", "failed", "cancelled")
FINISHED = (COMPLETED, FAILED, CANCELLED)


class ImageReference(BaseModel):
    """OpenAI's image reference object: `image_url` (an http(s) URL or a base64 data URL) or
    `file_id` (a Files API id, which this server does not have)."""

    model_config = ConfigDict(extra="forbid")
    image_url: str | None = None
    file_id: str | None = None


class VideoCreateRequest(DiffusionParams):
    """POST /v1/videos (JSON or multipart). Give `seconds` or `num_frames`, not both.

    `input_reference` here is the image as text: a data URL, a base64 string, an http(s) URL
    (fetched only from --allowed-image-domains) or an `ImageReference`; a multipart upload of
    the file under the same name comes to the serving code as bytes instead."""

    seconds: float | None = Field(default=None, gt=0)
    num_frames: int | None = Field(default=None, ge=1)
    fps: int | None = Field(default=None, ge=1, le=120)
    quality: str | None = None  # accepted for OpenAI compatibility, unused
    input_reference: str | ImageReference | None = None


@dataclass
class VideoJob:
    """One video job as GET /v1/videos/{id} shows it."""

    id: str
    model: str
    prompt: str
    size: str
    num_frames: int
    fps: int
    created_at: int
    status: str = QUEUED
    progress: int = 0  # percent of denoising steps done
    steps_done: int = 0
    total_steps: int = 0
    completed_at: int | None = None
    error: dict[str, Any] | None = None
    seed: int | None = None
    cached_steps: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "video",
            "model": self.model,
            "status": self.status,
            "progress": self.progress,
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": None,
            "prompt": self.prompt,
            "size": self.size,
            "seconds": f"{self.num_frames / self.fps:g}",
            "num_frames": self.num_frames,
            "fps": self.fps,
            "steps_done": self.steps_done,
            "total_steps": self.total_steps,
            "cached_steps": self.cached_steps,
            "seed": self.seed,
            "error": self.error,
        }
