"""Typed payloads of the diffusion engine: requests from the gateway, events back to it, and the
static facts of a served model (`ModelSpec`).

This module must not import torch: the gateway imports it. numpy is fine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TEXT_TO_IMAGE = "text-to-image"
TEXT_TO_VIDEO = "text-to-video"
IMAGE_EDIT = "image-edit"  # an instruction applied to one or more reference images
INPAINTING = "inpainting"  # repaint the white part of a mask over an image
IMAGE_TO_VIDEO = "image-to-video"  # a video that starts from a reference image
TASKS = (TEXT_TO_IMAGE, TEXT_TO_VIDEO, IMAGE_EDIT, INPAINTING, IMAGE_TO_VIDEO)
VIDEO_TASKS = (TEXT_TO_VIDEO, IMAGE_TO_VIDEO)
# Tasks whose requests must bring reference images (and, for inpainting, a mask).
IMAGE_INPUT_TASKS = (IMAGE_EDIT, INPAINTING, IMAGE_TO_VIDEO)

# ErrorEvent.status values (HTTP semantics).
STATUS_BAD_INPUT = 400
STATUS_UNKNOWN_MODEL = 404
STATUS_CANCELLED = 499
STATUS_BUG = 500
STATUS_UNAVAILABLE = 503

# Worker settings the CLI offers (`--step-cache`, `--diffusion-offload`,
# `--diffusion-quantization`); step_cache.STEP_CACHES and pipelines/memory.py implement them.
STEP_CACHE_KINDS = ("none", "dbcache")
OFFLOAD_MODES = ("none", "model", "sequential")
DIFFUSION_QUANTIZATIONS = ("none", "int8wo")


@dataclass(frozen=True)
class StepCacheConfig:
    """DBCache (cache-dit) settings of one request.

    `fn` / `bn`: transformer blocks always computed at the front / back of the stack; the residual
    of the front blocks decides whether the middle ones are reused. A step is cached when the
    relative L1 change of that residual is below `residual_diff_threshold` (0 = never cache).
    `warmup_steps` are always computed; `max_cached_steps` caps cached steps (-1 = no cap).
    """

    enabled: bool = False
    residual_diff_threshold: float = 0.08
    fn: int = 1
    bn: int = 0
    warmup_steps: int = 0
    max_cached_steps: int = -1
    taylorseer: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.residual_diff_threshold <= 10.0:
            raise ValueError(
                "step_cache.residual_diff_threshold must be between 0 and 10, "
                f"got {self.residual_diff_threshold}"
            )
        if self.fn < 1:
            raise ValueError(f"step_cache.fn (front blocks computed) must be >= 1, got {self.fn}")
        if self.bn < 0:
            raise ValueError(f"step_cache.bn (back blocks computed) must be >= 0, got {self.bn}")
        if self.warmup_steps < 0:
            raise ValueError(f"step_cache.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.max_cached_steps < -1:
            raise ValueError(
                f"step_cache.max_cached_steps must be -1 (no cap) or >= 0, "
                f"got {self.max_cached_steps}"
            )


@dataclass
class DiffusionRequest:
    """One generation request. None fields take the model's defaults (see `ModelSpec`).

    Checks that need the model (size multiple, frame rule, step range) live in
    `genserve.multimodal_gen.validation.resolve_request`, which raises ValueError.
    """

    rid: str
    model: str
    prompt: str
    negative_prompt: str | None = None
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    fps: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    num_outputs: int = 1
    step_cache: StepCacheConfig | None = None  # None = the server's default
    preview: bool = False
    # 0 = cheap latent->RGB projection every step; N > 0 = full VAE decode every N steps.
    preview_decode_every: int = 0
    init_image: bytes | None = None  # encoded image (PNG/JPEG/WebP) for image-to-image
    strength: float | None = None  # image-to-image: fraction of the schedule re-noised
    # Encoded images the model is conditioned on (edit, inpainting, image-to-video), and the
    # inpainting mask (white = repaint), the size of the first image.
    reference_images: tuple[bytes, ...] = ()
    mask_image: bytes | None = None
    # LoRA adapters loaded at start (by name) and their scales; None or {} = none.
    loras: dict[str, float] | None = None
    # False: no StepEvent (only the result), for callers that wait for the end: each event
    # wakes the gateway twice while the worker's threads are busy denoising.
    progress: bool = True
    # Streaming models: the request makes the next chunk of the worker-held stream
    # `stream_id` (streams.py); `stream_reset` starts it anew (its first chunk, or a new scene).
    stream_id: str | None = None
    stream_reset: bool = False
    # A frame deadline (time.time() by which its next frame is due): realtime and streaming
    # chunks carry one; the worker runs them first, pausing batch work at a step boundary.
    deadline: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            raise ValueError("prompt must be a string")
        if self.num_outputs < 1:
            raise ValueError(f"n (number of outputs) must be >= 1, got {self.num_outputs}")
        if self.preview_decode_every < 0:
            raise ValueError(
                f"preview_decode_every must be >= 0, got {self.preview_decode_every}"
            )


@dataclass
class StepEvent:
    """`step` denoising steps (1-based) of `total_steps` are done."""

    rid: str
    step: int
    total_steps: int
    preview: np.ndarray | None = None  # uint8 [num_frames, H, W, 3] of output 0, if req.preview


@dataclass
class ResultEvent:
    rid: str
    outputs: list[np.ndarray]  # one uint8 [num_frames, H, W, 3] per output (1 frame for images)
    fps: int | None
    cached_steps: int  # denoising steps served from the step cache (per output)
    total_steps: int
    timings: dict[str, float] = field(default_factory=dict)  # ms: queue, denoise, decode, total
    seeds: list[int] = field(default_factory=list)  # the seed each output used
    batch_size: int = 1  # requests that shared the pipeline call


@dataclass
class ErrorEvent:
    """400 bad input, 404 unknown model, 499 cancelled, 500 bug, 503 worker dead/queue full."""

    rid: str
    message: str
    status: int


DiffusionEvent = StepEvent | ResultEvent | ErrorEvent


@dataclass(frozen=True)
class ModelSpec:
    """Static facts of one served diffusion model, used for validation and /v1/models."""

    name: str
    task: str  # one of TASKS
    family: str  # "flux", "sd3", "sd", "wan", "ltx", "sdxl", "qwen-image", ...
    size_factor: int  # width and height must be multiples of this
    max_pixels: int  # width * height cap
    default_width: int
    default_height: int
    default_steps: int
    default_guidance: float
    min_steps: int = 1
    max_steps: int = 200
    min_guidance: float = 0.0
    max_guidance: float = 30.0
    default_num_frames: int = 1
    frame_rule: str = "1"  # "1" (images), "4k+1" (Wan), "8k+1" (LTX), "any", "N" (exactly N)
    max_num_frames: int = 1
    default_fps: int | None = None
    supports_negative_prompt: bool = True
    supports_image_to_image: bool = False
    source: str = ""  # folder, hub id or "embedded"
    square_only: bool = False  # width must equal height
    native_size: str | None = None  # drawn at this size; larger sizes are upscaled (bilinear)
    prompt_grammar: str | None = None  # the prompts the model understands, when it is narrow
    # Reference images a request brings: it must for IMAGE_INPUT_TASKS; a text-to-image model
    # with a count here may (FLUX.2 edits from references on its one pipeline).
    max_reference_images: int = 0
    min_reference_side: int = 0  # pixels each side of a reference image needs at least
    lora_adapters: tuple[str, ...] = ()  # LoRA adapters loaded at start
    scheduler: tuple[tuple[str, Any], ...] = ()  # the checkpoint's scheduler: class, settings
    step_cache: bool = True  # the denoiser supports the step cache
    # Autoregressive with history (Helios): a video is whole chunks of default_num_frames,
    # and a realtime session continues one video chunk after chunk (streams.py).
    streaming: bool = False

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.size_factor < 1 or self.max_pixels < 1:
            raise ValueError("size_factor and max_pixels must be positive")
        if not self.min_steps <= self.default_steps <= self.max_steps:
            raise ValueError("default_steps must lie in [min_steps, max_steps]")
        if self.task in IMAGE_INPUT_TASKS and self.max_reference_images < 1:
            raise ValueError(f"a {self.task} model needs max_reference_images >= 1")
        if self.task not in (*IMAGE_INPUT_TASKS, TEXT_TO_IMAGE) and self.max_reference_images:
            raise ValueError(f"a {self.task} model takes no reference images")

    @property
    def is_video(self) -> bool:
        return self.task in VIDEO_TASKS

    def frame_count_ok(self, num_frames: int) -> bool:
        """Whether the model can produce exactly `num_frames` frames."""
        if num_frames < 1 or num_frames > self.max_num_frames:
            return False
        if self.frame_rule == "any":
            return True
        if self.frame_rule.isdigit():
            return num_frames == int(self.frame_rule)
        k, _, one = self.frame_rule.partition("k+")
        return (num_frames - int(one)) % int(k) == 0

    def to_model_card(self) -> dict[str, Any]:
        """The /v1/models entry."""
        card: dict[str, Any] = {
            "id": self.name,
            "object": "model",
            "owned_by": "genserve",
            "kind": "diffusion",
            "task": self.task,
            "family": self.family,
            "default_size": f"{self.default_width}x{self.default_height}",
            "size_factor": self.size_factor,
            "max_pixels": self.max_pixels,
            "default_steps": self.default_steps,
            "default_guidance": self.default_guidance,
            "step_cache": self.step_cache,
        }
        if self.streaming:
            card["streaming"] = True
            card["chunk_frames"] = self.default_num_frames
        if self.max_reference_images:
            card["max_reference_images"] = self.max_reference_images
        if self.supports_image_to_image:
            card["image_to_image"] = True
        if self.lora_adapters:
            card["lora_adapters"] = list(self.lora_adapters)
        if self.scheduler:
            card["scheduler"] = dict(self.scheduler)
        if self.is_video:
            card.update(
                default_num_frames=self.default_num_frames,
                frame_rule=self.frame_rule,
                default_fps=self.default_fps,
            )
        if self.square_only:
            card["square_only"] = True
        if self.native_size:
            card["native_size"] = self.native_size
            card["upscaling"] = "bilinear, from the native size to the requested size"
        if self.prompt_grammar:
            card["prompt_grammar"] = self.prompt_grammar
        return card


# ---- gateway process <-> worker process (multiprocessing queues; pickled) ----


@dataclass
class WorkerSubmit:
    """A validated request with every default filled in (see validation.ResolvedRequest)."""

    request: Any  # ResolvedRequest


@dataclass
class WorkerCancel:
    rid: str


@dataclass
class WorkerShutdown:
    pass


@dataclass
class WorkerStreamEnd:
    """Free the worker-held state of a stream (its session stopped or went away)."""

    stream_id: str


@dataclass
class WorkerStreams:
    """Sent by the worker when the streams it holds change: how many, and their bytes."""

    streams: int
    nbytes: int


@dataclass
class WorkerHealth:
    """Sent by the worker when the result of its idle self-check changes: the failure, or
    None once it passes again. The worker keeps serving either way."""

    integrity_error: str | None


@dataclass
class WorkerReady:
    """First message of the worker: the models it loaded, or why it could not start."""

    specs: list[ModelSpec]
    error: str | None = None
    # What the server's memory plan needs (multimodal_gen/memory_report.py): the device, and
    # each model's resident weights and peak.
    memory: dict[str, Any] | None = None
    num_threads: int = 0  # the worker's torch threads, as it runs (thread_split.py)


@dataclass(frozen=True)
class ResolvedRequest:
    """A request after validation against its `ModelSpec`: every field concrete.

    Output i uses seed `seeds[i]`, so a request's outputs do not depend on what it is batched
    with. `batch_key` groups requests that may run as one pipeline call.
    """

    rid: str
    model: str
    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    num_frames: int
    fps: int | None
    num_inference_steps: int
    guidance_scale: float
    seeds: tuple[int, ...]
    step_cache: StepCacheConfig
    preview: bool
    preview_decode_every: int
    init_image: bytes | None
    strength: float | None
    submitted_at: float  # time.time() when the gateway accepted it
    progress: bool = True  # StepEvents wanted (they are always sent with previews)
    reference_images: tuple[bytes, ...] = ()
    mask_image: bytes | None = None
    # Identifies reference_images + mask_image (empty without them): requests conditioned on
    # different images never share a pipeline call, which takes one set for all its rows.
    condition_digest: str = ""
    loras: tuple[tuple[str, float], ...] = ()  # (adapter, scale), sorted by name
    stream_id: str | None = None  # see DiffusionRequest
    stream_reset: bool = False
    deadline: float | None = None  # see DiffusionRequest

    @property
    def urgent(self) -> bool:
        """It has a frame deadline: it runs ahead of batch work (batcher.py)."""
        return self.deadline is not None

    @property
    def num_outputs(self) -> int:
        return len(self.seeds)

    @property
    def batch_key(self) -> tuple:
        # Requests agreeing on everything that shapes the pipeline call can share it. Some run
        # alone: image-to-image (each has its own init image), and step-cached ones, because
        # DBCache decides to reuse a step from the residuals of the whole batch, so a
        # neighbour could change which steps this request caches (and so its pixels).
        caching = self.step_cache.enabled and self.step_cache.residual_diff_threshold > 0
        alone = self.rid if self.init_image is not None or caching else None
        return (
            self.model,
            self.width,
            self.height,
            self.num_frames,
            self.num_inference_steps,
            self.guidance_scale,
            self.negative_prompt is not None,
            self.step_cache,
            self.condition_digest,
            self.loras,
            self.stream_id is not None,  # one chunk of a stream, or a whole video
            alone,
        )


# ---- rank 0 of a context-parallel group <-> the other ranks (pipes; pickled) ----


@dataclass(frozen=True)
class ContextParallelRank:
    """Where one rank of a `--diffusion-cp N` group stands: its rank, the group's size and the
    TCP address of the group's rendezvous on 127.0.0.1."""

    rank: int
    size: int
    init_method: str  # "tcp://127.0.0.1:PORT"


@dataclass
class CPRun:
    """Rank 0 -> the others: run this batch (the same pipeline call, with the same seeds)."""

    batch: list[Any]  # list[ResolvedRequest]


class StepDecision(enum.Enum):
    """What a pipeline call does after a step hook: the worker decides it (worker.py), the
    family leaves the diffusers loop through its `interrupt` flag (pipelines/base.py), and rank 0
    relays it to the other ranks of a context-parallel group (`CPStep`)."""

    CONTINUE = "continue"
    CANCEL = "cancel"  # every request of the batch was cancelled: leave the call, drop it
    REGROUP = "regroup"  # requests that can join arrived: leave the call, queue it again


class FailureKind(enum.Enum):
    """Why a rank's pipeline call failed (`CPDone.kind`)."""

    BAD_INPUT = "bad_input"  # a ValueError every rank meets alike: the group stays in step
    BUG = "bug"  # anything else: the rank may be out of step with the group, so it leaves


@dataclass
class CPStep:
    """Rank 0 -> the others, at every step hook: the decision rank 0 took, so that a cancel or
    a regroup leaves the call at the same step on every rank."""

    decision: StepDecision


@dataclass
class CPDone:
    """Another rank -> rank 0: it loaded its models (first message), or it ended the last
    CPRun; `error` says why not and `kind` what that failure means for the group."""

    error: str | None = None
    kind: FailureKind | None = None
