"""What one realtime session generates: the start message checked against the model's spec."""

from __future__ import annotations

from dataclasses import dataclass

from genserve.entrypoints.realtime.frames import FrameFormat
from genserve.entrypoints.realtime.protocol import ProtocolError, StartMessage
from genserve.multimodal_gen.client import DiffusionEngineClient
from genserve.multimodal_gen.messages import (
    TEXT_TO_IMAGE,
    TEXT_TO_VIDEO,
    DiffusionRequest,
    StepCacheConfig,
)
from genserve.multimodal_gen.validation import MAX_SEED, resolve_request

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
    seed: int  # chunk i uses seed + i, so continuous chunks differ but replay the same
    preview_format: FrameFormat
    preview_quality: int
    preview_decode_every: int
    continuous: bool
    max_chunks: int | None  # None = until stopped (continuous) ; 1 otherwise

    def request(self, request_id: str, chunk: int, prompt: str) -> DiffusionRequest:
        """The diffusion request of chunk `chunk` (previews on)."""
        return DiffusionRequest(
            request_id=request_id,
            model=self.model,
            prompt=prompt,
            negative_prompt=self.negative_prompt,
            width=self.width,
            height=self.height,
            num_frames=self.num_frames,
            fps=self.fps,
            num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale,
            seed=(self.seed + chunk) % (MAX_SEED - 8),
            preview=True,
            preview_decode_every=self.preview_decode_every,
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
        }


def resolve_settings(client: DiffusionEngineClient, msg: StartMessage) -> SessionSettings:
    """Check `msg` against the model; ProtocolError with an actionable message if it is bad."""
    model = msg.model or client.default_model(TEXT_TO_VIDEO) or client.default_model(TEXT_TO_IMAGE)
    if model is None:
        raise ProtocolError("model_not_found", "This server serves no diffusion model.")
    try:
        spec = client.model_spec(model)
    except KeyError:
        served = ", ".join(s["id"] for s in client.list_models()) or "none"
        raise ProtocolError(
            "model_not_found", f"The model {model!r} is not served. Served models: {served}."
        ) from None
    draft = DiffusionRequest(
        request_id="realtime-check",
        model=model,
        prompt=msg.prompt,
        negative_prompt=msg.negative_prompt,
        width=msg.width,
        height=msg.height,
        num_frames=msg.num_frames,
        fps=msg.fps,
        num_inference_steps=msg.num_inference_steps,
        guidance_scale=msg.guidance_scale,
        seed=msg.seed,
        preview=True,
        preview_decode_every=msg.preview_decode_every,
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
    )
