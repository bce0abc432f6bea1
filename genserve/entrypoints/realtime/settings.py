"""What one realtime session generates: the start message checked against the model's spec."""

from __future__ import annotations

import time
from dataclasses import dataclass

from genserve.entrypoints.realtime.frames import FrameFormat
from genserve.entrypoints.realtime.protocol import ProtocolError, StartMessage
from genserve.multimodal_gen.client import DiffusionEngineClient
from genserve.multimodal_gen.messages import (
    IMAGE_INPUT_TASKS,
    TEXT_TO_IMAGE,
    TEXT_TO_VIDEO,
    DiffusionRequest,
    ModelSpec,
    StepCacheConfig,
)
from genserve.multimodal_gen.validation import MAX_SEED, image_size, resolve_request
from genserve.srt.multimodal.image_source import ImageInputError, decode_inline

# Pacing of final frames for models that have no frame rate (image models).
FALLBACK_FPS = 8


@dataclass(frozen=True)
class SessionSettings:
    model: str
    negative_prompt: str | None
    width: int
    height: int
    num_frames: int
    fps: int
    num_inference_steps: int
    guidance_scale: float
    # Chunk i uses seed + i, so continuous chunks differ but replay the same; a streaming
    # model's scene j (after j resets) is seeded seed + j and continues from chunk to chunk.
    seed: int
    preview_format: FrameFormat
    preview_quality: int
    preview_decode_every: int
    continuous: bool
    max_chunks: int | None  # None = until stopped (continuous) ; 1 otherwise
    task: str = TEXT_TO_VIDEO  # the model's task
    # Encoded input images of every chunk (see `_image_inputs`).
    reference_images: tuple[bytes, ...] = ()
    mask_image: bytes | None = None
    init_image: bytes | None = None
    strength: float | None = None
    streaming: bool = False  # the model continues one video chunk after chunk

    def request(self, rid: str, chunk: int, prompt: str, stream_id: str | None = None,
                scene: int = 0, reset: bool = False) -> DiffusionRequest:
        """The diffusion request of chunk `chunk` (previews on). On a streaming model, the
        next chunk of stream `stream_id`, `reset` when it starts scene `scene`."""
        seed = (self.seed + (scene if stream_id is not None else chunk)) % (MAX_SEED - 8)
        return DiffusionRequest(
            rid=rid,
            model=self.model,
            prompt=prompt,
            negative_prompt=self.negative_prompt,
            width=self.width,
            height=self.height,
            num_frames=self.num_frames,
            fps=self.fps,
            num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale,
            seed=seed,
            preview=True,
            preview_decode_every=self.preview_decode_every,
            reference_images=self.reference_images,
            mask_image=self.mask_image,
            init_image=self.init_image,
            strength=self.strength,
            stream_id=stream_id,
            stream_reset=reset,
            # Its first frame is due one frame interval from now: it runs ahead of batch work.
            deadline=time.time() + 1.0 / self.fps,
        )

    def describe(self) -> dict[str, object]:
        """The resolved values, echoed to the client in `started`."""
        return {
            "model": self.model,
            "width": self.width,
            "height": self.height,
            "num_frames": self.num_frames,
            "fps": self.fps,
            "num_inference_steps": self.num_inference_steps,
            "guidance_scale": self.guidance_scale,
            "seed": self.seed,
            "preview_format": self.preview_format.name.lower(),
            "preview_quality": self.preview_quality,
            "continuous": self.continuous,
            "task": self.task,
            "images": len(self.reference_images) + (self.init_image is not None),
            "streaming": self.streaming,
        }


def _default_model(client: DiffusionEngineClient) -> str | None:
    """A streaming model first (one continuous video), then any text-to-video model (a clip
    per chunk), then a text-to-image model (a picture per chunk)."""
    streaming = next((s.name for s in client.specs() if s.streaming), None)
    return streaming or client.default_model(TEXT_TO_VIDEO) or client.default_model(TEXT_TO_IMAGE)


def resolve_settings(client: DiffusionEngineClient, msg: StartMessage) -> SessionSettings:
    """Check `msg` against the model; ProtocolError with an actionable message if it is bad."""
    model = msg.model or _default_model(client)
    if model is None:
        raise ProtocolError("model_not_found", "This server serves no diffusion model.")
    try:
        spec = client.model_spec(model)
    except KeyError:
        served = ", ".join(s["id"] for s in client.list_models()) or "none"
        raise ProtocolError(
            "model_not_found", f"The model {model!r} is not served. Served models: {served}."
        ) from None
    inputs = _image_inputs(msg, spec)
    width, height = msg.width, msg.height
    if inputs["init_image"] is not None and width is None and height is None:
        # Image-to-image keeps the picture's size, as /v1/images/edits does.
        try:
            width, height = image_size(inputs["init_image"], "images.0")
        except ValueError:
            raise ProtocolError("invalid_request", "images.0 could not be decoded as an image "
                                "(PNG, JPEG or WebP).") from None
    draft = DiffusionRequest(
        rid="realtime-check",
        model=model,
        prompt=msg.prompt,
        negative_prompt=msg.negative_prompt,
        width=width,
        height=height,
        num_frames=msg.num_frames,
        fps=msg.fps,
        num_inference_steps=msg.num_inference_steps,
        guidance_scale=msg.guidance_scale,
        seed=msg.seed,
        preview=True,
        preview_decode_every=msg.preview_decode_every,
        # A streaming model checks its stream options (chunk size, no input image) up front.
        stream_id="realtime-check" if spec.streaming else None,
        stream_reset=spec.streaming,
        **inputs,
    )
    try:
        resolved = resolve_request(draft, spec, StepCacheConfig())
    except ValueError as exc:
        raise ProtocolError("invalid_request", str(exc)) from None
    return SessionSettings(
        model=resolved.model,
        negative_prompt=resolved.negative_prompt,
        width=resolved.width,
        height=resolved.height,
        num_frames=resolved.num_frames,
        fps=resolved.fps or FALLBACK_FPS,
        num_inference_steps=resolved.num_inference_steps,
        guidance_scale=resolved.guidance_scale,
        seed=resolved.seeds[0],
        preview_format=FrameFormat.from_name(msg.preview_format),
        preview_quality=msg.preview_quality,
        preview_decode_every=msg.preview_decode_every,
        continuous=msg.continuous,
        max_chunks=msg.max_chunks if msg.continuous else 1,
        task=spec.task,
        reference_images=resolved.reference_images,
        mask_image=resolved.mask_image,
        init_image=resolved.init_image,
        strength=resolved.strength,
        streaming=spec.streaming,
    )


def _decode(source: str, field: str) -> bytes:
    try:
        data = decode_inline(source)
    except ImageInputError as exc:
        raise ProtocolError("invalid_request", f"{field}: {exc}.") from None
    if data is None:
        raise ProtocolError("invalid_request", f"{field}: send the image itself as a data URL "
                            "or base64 string; URLs are not fetched here.")
    return data


def _image_inputs(msg: StartMessage, spec: ModelSpec) -> dict[str, object]:
    """The start message's images as DiffusionRequest fields: reference images (and mask) for
    an image-edit, inpainting or image-to-video model, the starting picture of image-to-image
    for a text-to-image model. What the model cannot take is refused by `resolve_request`."""
    images = tuple(_decode(source, f"images.{i}") for i, source in enumerate(msg.images))
    mask = _decode(msg.mask, "mask") if msg.mask is not None else None
    if msg.strength is not None and (spec.task in IMAGE_INPUT_TASKS or not images
                                     or not spec.supports_image_to_image):
        raise ProtocolError("invalid_request", "strength applies to image-to-image only: send "
                            "one image with a text-to-image model that supports it.")
    if spec.task in IMAGE_INPUT_TASKS or not images or not spec.supports_image_to_image:
        return {"reference_images": images, "mask_image": mask, "init_image": None,
                "strength": None}
    if len(images) > 1:
        raise ProtocolError("invalid_request", f"model {spec.name} starts image-to-image from "
                            f"one picture, got {len(images)}.")
    if mask is not None:
        raise ProtocolError("invalid_request", f"model {spec.name} does not inpaint (it takes "
                            "no mask); use an inpainting model.")
    return {"reference_images": (), "mask_image": None, "init_image": images[0],
            "strength": msg.strength}


