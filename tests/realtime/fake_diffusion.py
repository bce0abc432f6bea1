"""A small in-process DiffusionEngineClient for the realtime tests: numpy frames, real timing.

It follows the client contract: validation errors come back as a single ErrorEvent, steps take
`step_delay_s` each, previews are uint8 [num_frames, H/2, W/2, 3] (like a cheap latent
projection: smaller than the output), and closing the stream early cancels the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import numpy as np

from genserve.multimodal_gen.client import DiffusionEngineClient
from genserve.multimodal_gen.messages import (
    TEXT_TO_VIDEO,
    DiffusionEvent,
    DiffusionRequest,
    ErrorEvent,
    ModelSpec,
    ResultEvent,
    StepCacheConfig,
    StepEvent,
)
from genserve.multimodal_gen.validation import resolve_request

FAKE_VIDEO = ModelSpec(
    name="fake-video",
    task=TEXT_TO_VIDEO,
    family="wan",
    size_factor=16,
    max_pixels=512 * 512,
    default_width=64,
    default_height=48,
    default_steps=4,
    default_guidance=1.0,
    max_steps=64,
    default_num_frames=5,
    frame_rule="4k+1",
    max_num_frames=65,
    default_fps=12,
)


def fake_frames(seed: int, num_frames: int, height: int, width: int) -> np.ndarray:
    """uint8 [num_frames, H, W, 3]: a seeded colour with a bar that moves one step per frame."""
    rng = np.random.default_rng(seed)
    base = rng.integers(40, 200, size=3, dtype=np.uint8)
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    frames[:] = base
    bar = max(1, width // 8)
    for i in range(num_frames):
        x = (i * bar) % width
        frames[i, :, x : x + bar] = 255 - base
    return frames


class FakeDiffusionClient(DiffusionEngineClient):
    def __init__(self, step_delay_s: float = 0.02,
                 on_request: Callable[[DiffusionRequest], None] | None = None) -> None:
        self.step_delay_s = step_delay_s
        self.on_request = on_request  # called as each request starts (tests snapshot state)
        self.running: set[str] = set()
        self.cancelled: set[str] = set()
        self.finished: set[str] = set()
        self.requests: list[DiffusionRequest] = []
        self.steps_run: dict[str, int] = {}  # denoising steps each request got through

    def specs(self) -> list[ModelSpec]:
        return [FAKE_VIDEO]

    async def stream(self, req: DiffusionRequest) -> AsyncIterator[DiffusionEvent]:
        try:
            spec = self.model_spec(req.model)
        except KeyError:
            yield ErrorEvent(req.rid, f"unknown model {req.model!r}", 404)
            return
        try:
            r = resolve_request(req, spec, StepCacheConfig())
        except ValueError as exc:
            yield ErrorEvent(req.rid, str(exc), 400)
            return
        self.requests.append(req)
        if self.on_request is not None:
            self.on_request(req)
        self.running.add(req.rid)
        try:
            frames = fake_frames(r.seeds[0], r.num_frames, r.height, r.width)
            for step in range(1, r.num_inference_steps + 1):
                await asyncio.sleep(self.step_delay_s)
                if req.rid in self.cancelled:
                    yield ErrorEvent(req.rid, "cancelled", 499)
                    return
                self.steps_run[req.rid] = step
                preview = None
                if req.preview:
                    # Noisier early, converging on the final frames (half resolution).
                    noise = np.random.default_rng(step).integers(0, 255, frames.shape, np.uint8)
                    w = step / r.num_inference_steps
                    mixed = (w * frames + (1 - w) * noise).astype(np.uint8)
                    preview = mixed[:, ::2, ::2]
                yield StepEvent(req.rid, step, r.num_inference_steps, preview)
            self.finished.add(req.rid)
            yield ResultEvent(req.rid, [frames], r.fps, 0, r.num_inference_steps,
                              {"denoise": 1.0}, list(r.seeds))
        finally:
            if req.rid not in self.finished:
                self.cancelled.add(req.rid)  # closed early: the worker would stop here
            self.running.discard(req.rid)

    async def cancel(self, rid: str) -> bool:
        if rid in self.running:
            self.cancelled.add(rid)
            return True
        return False

    def is_healthy(self) -> bool:
        return True

    def queue_depth(self) -> int:
        return len(self.running)

    async def shutdown(self) -> None:
        return None
