"""Check a `DiffusionRequest` against its model's `ModelSpec` and fill in the defaults.

Runs in the gateway process (no torch), so bad input is answered before it reaches the worker.
Every message says what was wrong and what would be accepted; nothing is rounded silently.
"""

from __future__ import annotations

import hashlib
import io
import random
import time

from genserve.multimodal_gen.messages import (
    IMAGE_INPUT_TASKS,
    INPAINTING,
    DiffusionRequest,
    ModelSpec,
    ResolvedRequest,
    StepCacheConfig,
)

MAX_OUTPUTS = 8
MAX_LORA_SCALE = 8.0
MAX_SEED = 2**63 - 1


def parse_size(size: str) -> tuple[int, int]:
    """'WxH' -> (width, height); ValueError for anything else."""
    parts = str(size).lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"size must look like '512x512' (WIDTHxHEIGHT in pixels), got {size!r}")
    return int(parts[0]), int(parts[1])


def _check_size(width: int, height: int, spec: ModelSpec) -> None:
    f = spec.size_factor
    for name, value in (("width", width), ("height", height)):
        if value < f:
            raise ValueError(
                f"{name} must be at least {f} pixels for model {spec.name}, got {value}"
            )
        if value % f:
            lo, hi = value - value % f, value - value % f + f
            raise ValueError(
                f"{name} {value} is not a multiple of {f}, which model {spec.name} requires; "
                f"use {lo} or {hi}"
            )
    if spec.square_only and width != height:
        raise ValueError(
            f"model {spec.name} draws square pictures; width and height must be equal, got "
            f"{width}x{height}"
        )
    if width * height > spec.max_pixels:
        raise ValueError(
            f"size {width}x{height} has {width * height} pixels, over the cap of "
            f"{spec.max_pixels} for model {spec.name}; ask for a smaller size"
        )


def _check_frames(num_frames: int, spec: ModelSpec) -> None:
    if not spec.is_video:
        if num_frames != 1:
            raise ValueError(f"model {spec.name} makes images; num_frames must be 1")
        return
    if spec.frame_count_ok(num_frames):
        return
    if num_frames > spec.max_num_frames:
        raise ValueError(
            f"num_frames {num_frames} is over the cap of {spec.max_num_frames} for model "
            f"{spec.name}"
        )
    if spec.frame_rule.isdigit():
        raise ValueError(f"model {spec.name} makes exactly {spec.frame_rule} frames; "
                         f"num_frames must be {spec.frame_rule}, got {num_frames}")
    k, _, one = spec.frame_rule.partition("k+")
    k_i, one_i = int(k), int(one)
    below = max(one_i or k_i, ((num_frames - one_i) // k_i) * k_i + one_i)
    raise ValueError(
        f"num_frames {num_frames} does not fit model {spec.name}: it needs {spec.frame_rule} "
        f"frames (k a whole number, e.g. {below} or {below + k_i})"
    )


def _check_steps_guidance(steps: int, guidance: float, spec: ModelSpec) -> None:
    if not spec.min_steps <= steps <= spec.max_steps:
        raise ValueError(
            f"num_inference_steps must be between {spec.min_steps} and {spec.max_steps}, "
            f"got {steps}"
        )
    if not spec.min_guidance <= guidance <= spec.max_guidance:
        raise ValueError(
            f"guidance_scale must be between {spec.min_guidance} and {spec.max_guidance}, "
            f"got {guidance}"
        )


def image_size(data: bytes, what: str) -> tuple[int, int]:
    """(width, height) of an encoded image; ValueError when PIL cannot decode it. The one
    place the gateway decodes an uploaded image (validation, /v1/images/edits, realtime)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return image.size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ValueError(f"{what} could not be decoded as an image (PNG, JPEG or WebP): "
                         f"{exc}") from None


def _check_conditions(req: DiffusionRequest, spec: ModelSpec) -> tuple[int, int] | None:
    """Check the reference images and mask against the model's task; returns the first image's
    size (None without images)."""
    images, mask = req.reference_images, req.mask_image
    if spec.task not in IMAGE_INPUT_TASKS:
        if images and not spec.max_reference_images:
            raise ValueError(f"model {spec.name} is a {spec.task} model and takes no reference "
                             "image; use an image-edit, inpainting or image-to-video model")
        if mask is not None:
            raise ValueError(f"model {spec.name} does not inpaint (it takes no mask); use an "
                             "inpainting model such as tiny-flux-fill")
        if not images:
            return None  # plain text-to-image
    if not images:
        raise ValueError(f"model {spec.name} ({spec.task}) needs a reference image")
    if len(images) > spec.max_reference_images:
        raise ValueError(f"model {spec.name} takes at most {spec.max_reference_images} "
                         f"reference image(s), got {len(images)}")
    sizes = [image_size(data, f"reference image {i + 1}") for i, data in enumerate(images)]
    for i, (w, h) in enumerate(sizes):
        if min(w, h) < spec.min_reference_side:
            raise ValueError(f"reference image {i + 1} is {w}x{h}; model {spec.name} needs "
                             f"at least {spec.min_reference_side} pixels on each side")
    if spec.task == INPAINTING:
        if mask is None:
            raise ValueError(f"model {spec.name} inpaints: the request needs a mask (white = "
                             "repaint, black = keep) the size of the image")
        mask_size = image_size(mask, "the mask")
        if mask_size != sizes[0]:
            raise ValueError(f"the mask is {mask_size[0]}x{mask_size[1]} but the image is "
                             f"{sizes[0][0]}x{sizes[0][1]}; they must be the same size")
    elif mask is not None:
        raise ValueError(f"model {spec.name} ({spec.task}) takes no mask; inpainting needs an "
                         "inpainting model such as tiny-flux-fill")
    return sizes[0]


def _size_from_image(size: tuple[int, int], spec: ModelSpec) -> tuple[int, int]:
    """The output size for an image-conditioned request that names none: the reference image's,
    scaled down to the pixel cap and rounded down to the size factor."""
    w, h = size
    scale = min(1.0, (spec.max_pixels / (w * h)) ** 0.5)
    f = spec.size_factor
    return max(f, int(w * scale) // f * f), max(f, int(h * scale) // f * f)


def _check_loras(req: DiffusionRequest, spec: ModelSpec) -> tuple[tuple[str, float], ...]:
    loras = req.loras or {}
    for name, scale in loras.items():
        if name not in spec.lora_adapters:
            have = ", ".join(spec.lora_adapters) or "none"
            raise ValueError(f"LoRA adapter {name!r} is not loaded for model {spec.name} "
                             f"(loaded: {have}; adapters are loaded at start with --lora)")
        if not isinstance(scale, int | float) or not -MAX_LORA_SCALE <= scale <= MAX_LORA_SCALE:
            raise ValueError(f"LoRA scale of {name!r} must be a number between "
                             f"{-MAX_LORA_SCALE} and {MAX_LORA_SCALE}, got {scale!r}")
    return tuple(sorted((name, float(scale)) for name, scale in loras.items()))


def _digest(req: DiffusionRequest) -> str:
    if not req.reference_images and req.mask_image is None:
        return ""
    h = hashlib.sha256()
    for data in (*req.reference_images, req.mask_image or b""):
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def resolve_request(
    req: DiffusionRequest, spec: ModelSpec, default_step_cache: StepCacheConfig
) -> ResolvedRequest:
    """Validate `req` for `spec`; returns it with every default filled in. Raises ValueError."""
    if not req.prompt.strip():
        raise ValueError("prompt must not be empty")
    if req.num_outputs > MAX_OUTPUTS:
        raise ValueError(f"n must be between 1 and {MAX_OUTPUTS}, got {req.num_outputs}")
    image_size = _check_conditions(req, spec)
    default_w, default_h = spec.default_width, spec.default_height
    if image_size is not None:
        default_w, default_h = _size_from_image(image_size, spec)
    width = default_w if req.width is None else int(req.width)
    height = default_h if req.height is None else int(req.height)
    _check_size(width, height, spec)
    num_frames = spec.default_num_frames if req.num_frames is None else int(req.num_frames)
    _check_frames(num_frames, spec)
    steps = spec.default_steps if req.num_inference_steps is None else int(req.num_inference_steps)
    guidance = spec.default_guidance if req.guidance_scale is None else float(req.guidance_scale)
    _check_steps_guidance(steps, guidance, spec)
    fps = req.fps if req.fps is not None else spec.default_fps
    if fps is not None and not 1 <= fps <= 120:
        raise ValueError(f"fps must be between 1 and 120, got {fps}")
    if req.negative_prompt is not None and not spec.supports_negative_prompt:
        raise ValueError(f"model {spec.name} does not take a negative_prompt")
    if req.init_image is not None and not spec.supports_image_to_image:
        raise ValueError(f"model {spec.name} does not support image edits (image-to-image)")
    strength = req.strength
    if req.init_image is not None:
        strength = 0.8 if strength is None else float(strength)
        if not 0.0 < strength <= 1.0:
            raise ValueError(f"strength must be in (0, 1], got {strength}")
    _check_stream(req, spec, num_frames)
    seed = random.randrange(0, MAX_SEED - MAX_OUTPUTS) if req.seed is None else int(req.seed)
    if not 0 <= seed <= MAX_SEED - MAX_OUTPUTS:
        raise ValueError(f"seed must be between 0 and {MAX_SEED - MAX_OUTPUTS}, got {seed}")
    return ResolvedRequest(
        rid=req.rid,
        model=spec.name,
        prompt=req.prompt,
        negative_prompt=req.negative_prompt,
        width=width,
        height=height,
        num_frames=num_frames,
        fps=fps,
        num_inference_steps=steps,
        guidance_scale=guidance,
        seeds=tuple(seed + i for i in range(req.num_outputs)),
        step_cache=req.step_cache if req.step_cache is not None else default_step_cache,
        preview=req.preview,
        preview_decode_every=req.preview_decode_every,
        init_image=req.init_image,
        strength=strength,
        submitted_at=time.time(),
        progress=req.progress,
        reference_images=tuple(req.reference_images),
        mask_image=req.mask_image,
        condition_digest=_digest(req),
        loras=_check_loras(req, spec),
        stream_id=req.stream_id,
        stream_reset=req.stream_reset,
        deadline=req.deadline,
    )


def _check_stream(req: DiffusionRequest, spec: ModelSpec, num_frames: int) -> None:
    if req.stream_id is None:
        if req.stream_reset:
            raise ValueError("stream_reset needs a stream_id")
        return
    if not spec.streaming:
        raise ValueError(f"model {spec.name} cannot stream (it is not autoregressive with "
                         "history); use a streaming model such as Helios")
    if num_frames != spec.default_num_frames:
        raise ValueError(f"a stream of model {spec.name} makes one chunk of "
                         f"{spec.default_num_frames} frames per request, got {num_frames}")
    if req.num_outputs != 1:
        raise ValueError("a stream makes one output per chunk (n must be 1)")
    if req.init_image is not None or req.reference_images or req.mask_image is not None:
        raise ValueError("a stream takes no input image")
