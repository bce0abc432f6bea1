"""The diffusion families of the trained demo models (`shapes-image`, `shapes-video`,
`shapes-stream`), named by dotted path from their rows in `genserve.multimodal_gen.named_models`.

They denoise pixels directly (no VAE): the working "latents" are the native 32x32 picture with a
video's frames stacked on the channel axis, [B, 3F, 32, 32]. Unpacking splits the frames and
upscales to the requested size, so decoding is the identity and every preview is exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from genserve.demo_models import stream_model, world
from genserve.demo_models.models import DEFAULT_GUIDANCE, DEFAULT_STEPS
from genserve.demo_models.stream_follow import FollowStream, enter_frames, keep_chunks, roll_rows
from genserve.multimodal_gen.messages import (
    TEXT_TO_IMAGE,
    TEXT_TO_VIDEO,
    ResolvedRequest,
    StepDecision,
)
from genserve.multimodal_gen.pipelines.base import DiffusionFamily
from genserve.multimodal_gen.pipelines.helios import HeliosFamily
from genserve.multimodal_gen.pipelines.sd3 import SD3Family

_COMMON = dict(
    size_factor=world.SIZE, max_pixels=256 * 256, default_width=128, default_height=128,
    default_steps=DEFAULT_STEPS, min_steps=1, max_steps=100, max_guidance=20.0, square_only=True,
    native_size=f"{world.SIZE}x{world.SIZE}",
)


class _ShapesFamily(DiffusionFamily):
    family = "shapes"
    cache_blocks = SD3Family.cache_blocks  # both demo transformers are SD3 MMDiTs

    def call_kwargs(self, req: ResolvedRequest) -> dict[str, Any]:
        return {"guidance_scale": req.guidance_scale}

    def unpack_latents(self, latents: torch.Tensor, req: ResolvedRequest) -> torch.Tensor:
        if latents.ndim == 5:
            return latents
        return self.pipe.upscale(latents, req.height, req.width)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents  # already pixels in [-1, 1]

    def preview(self, tensors: dict[str, torch.Tensor], req: ResolvedRequest,
                full_decode: bool) -> np.ndarray:
        # The latents are the picture itself: a "cheap" preview is already exact.
        return self._to_uint8(tensors["latents"][:1])


class ShapesImageFamily(_ShapesFamily):
    task = TEXT_TO_IMAGE
    pipeline_classes = ("ShapesImagePipeline",)
    spec_defaults = dict(
        _COMMON, default_guidance=DEFAULT_GUIDANCE["image"],
        prompt_grammar=world.IMAGE_GRAMMAR + "; " + world.grammar_words(video=False))


class ShapesVideoFamily(_ShapesFamily):
    task = TEXT_TO_VIDEO
    pipeline_classes = ("ShapesVideoPipeline",)
    spec_defaults = dict(
        _COMMON, default_guidance=DEFAULT_GUIDANCE["video"], default_num_frames=world.NUM_FRAMES,
        max_num_frames=world.NUM_FRAMES, frame_rule=str(world.NUM_FRAMES), default_fps=8,
        prompt_grammar=world.VIDEO_GRAMMAR + "; " + world.grammar_words(video=True))


FRAME_OFFSET = "frame_offset"  # previews' per-row tensor: each stream's frame offset


class ShapesStreamFamily(HeliosFamily):
    """`shapes-stream`: Helios's chunk loop (history, prefix, streams; `pipelines/helios.py`)
    over a pixel-space or autoencoder-latent model (`stream_model.py`): a chunk decodes by
    the pipeline's `unpack` (larger sizes are upscaled), and the transformer's clean-chunk
    prediction becomes the velocity the Helios scheduler steps with. Each stream is drawn in
    a frame that follows its shape across the torus (`stream_follow`): the chunk loop moves
    it into that frame before each chunk and rolls the chunk's pixels back to the world."""

    family = "shapes-stream"
    pipeline_classes = ("ShapesStreamPipeline",)
    latents_per_chunk = stream_model.FRAMES_PER_CHUNK
    history_sizes = stream_model.HISTORY_SIZES
    spec_defaults = dict(
        size_factor=stream_model.MODEL_SIZE, max_pixels=256 * 256, default_width=128,
        default_height=128, default_steps=stream_model.DEFAULT_STEPS, min_steps=1, max_steps=20,
        default_guidance=1.0, max_guidance=10.0, square_only=True, default_fps=24,
        native_size=f"{stream_model.MODEL_SIZE}x{stream_model.MODEL_SIZE}",
        prompt_grammar=world.VIDEO_GRAMMAR + "; " + world.grammar_words(video=True))

    def checkpoint_defaults(self) -> dict:
        # The guidance its training run chose, in model_index.json (none in older folders).
        return {"default_guidance": float(self.pipe.config.get("guidance_scale", 1.0))}

    @property
    def chunk_frames(self) -> int:
        return stream_model.FRAMES_PER_CHUNK  # one latent frame is one frame (no time axis)

    def new_stream(self, seed: int, width: int, height: int) -> FollowStream:
        """A stream at the start of a video; it is drawn at the native size whatever the
        requested one (decode_chunk upscales)."""
        channels, side = self.pipe.latent_shape
        frames, size = sum(self.history_sizes), self.pipe.native_size
        history = torch.zeros(1, channels, frames, side, side, device=self.device,
                              dtype=torch.float32)
        pixels = torch.zeros(1, 3, frames, size, size, device=self.device, dtype=torch.float32)
        gen_device = "cpu" if self.device.type == "mps" else self.device
        return FollowStream(torch.Generator(device=gen_device).manual_seed(seed), history,
                            pixels=pixels)

    def _run_chunk(self, streams: list[FollowStream], rows: list[tuple[ResolvedRequest, int]],
                   head: ResolvedRequest, on_step: Any, steps_before: int
                   ) -> tuple[torch.Tensor | None, StepDecision]:
        """Helios's chunk, drawn in each stream's follow frame. Entering the frame only
        derives the latents from the stream's pixels, so a chunk that stops leaves nothing
        a re-run would draw differently."""
        enter_frames(self.pipe, streams)  # under inference mode
        return super()._run_chunk(streams, rows, head, on_step, steps_before)

    def _advance(self, streams: list[FollowStream], latents: torch.Tensor) -> None:
        super()._advance(streams, latents)
        keep_chunks(self.pipe, streams, latents)

    def row_tensors(self, streams: list[FollowStream]) -> dict[str, torch.Tensor]:
        return {FRAME_OFFSET: torch.cat([s.offset for s in streams])}

    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, embeds: torch.Tensor,
                 history: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.pipe.velocity(latents, timestep, embeds, history)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipe.unpack(latents.float()).clamp(-1, 1)

    def decode_chunk(self, latents: torch.Tensor, head: ResolvedRequest,
                     streams: list[FollowStream] | None = None,
                     offsets: torch.Tensor | None = None) -> torch.Tensor:
        """Pixels of the rows' latents where the world has them, at `head`'s size: the
        streams' chunks as the chunk loop already decoded them, or else the latents decoded
        here and rolled back by the streams' offsets or by `offsets` [B, 2] (a preview's)."""
        if streams is not None and all(s.drawn is not None for s in streams):
            pixels = torch.cat([s.drawn for s in streams])
            for s in streams:
                s.drawn = None
        else:
            pixels = self.decode(latents)
            if streams is not None:
                offsets = torch.cat([s.offset for s in streams])
            if offsets is not None:
                pixels = roll_rows(pixels, -offsets.to(torch.long))
        if (head.height, head.width) == tuple(pixels.shape[-2:]):
            return pixels
        b, c, f, h, w = pixels.shape
        flat = pixels.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
        flat = torch.nn.functional.interpolate(flat, size=(head.height, head.width),
                                               mode="bilinear", align_corners=False)
        return flat.view(b, f, c, head.height, head.width).permute(0, 2, 1, 3, 4)

    def preview(self, tensors: dict[str, torch.Tensor], req: ResolvedRequest,
                full_decode: bool) -> np.ndarray:
        # Every preview is exact: the decoder draws the latents, rolled back to the world.
        offsets = tensors.get(FRAME_OFFSET)
        with torch.inference_mode():
            return self._to_uint8(self.decode_chunk(
                tensors["latents"][:1], req, offsets=None if offsets is None else offsets[:1]))
