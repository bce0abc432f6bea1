"""Video jobs: created at once, run in the background on the diffusion client, encoded to MP4
and stored; progress is the fraction of denoising steps done (no torch)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from genserve.entrypoints.admission import Admission, new_rid
from genserve.entrypoints.diffusion.serving import (
    DiffusionRun,
    parse_size_param,
    request_step_cache,
    resolve_model,
)
from genserve.entrypoints.errors import APIError, bad_request, not_found
from genserve.entrypoints.metrics import GatewayMetrics
from genserve.entrypoints.videos.protocol import (
    CANCELLED,
    COMPLETED,
    FAILED,
    FINISHED,
    IN_PROGRESS,
    ImageReference,
    VideoCreateRequest,
    VideoJob,
)
from genserve.multimodal_gen.client import DiffusionClient
from genserve.multimodal_gen.encoding import encode_mp4
from genserve.multimodal_gen.messages import (
    IMAGE_TO_VIDEO,
    STATUS_CANCELLED,
    TEXT_TO_VIDEO,
    DiffusionEvent,
    DiffusionRequest,
    ModelSpec,
    ResultEvent,
    StepCacheConfig,
    StepEvent,
)
from genserve.multimodal_gen.output_store import OutputStore
from genserve.multimodal_gen.validation import MAX_OUTPUTS, MAX_SEED, resolve_request
from genserve.srt.multimodal.image_source import ImageFetchPolicy, ImageInputError, load_image_bytes

logger = logging.getLogger(__name__)
VIDEO_STORE_MAX_BYTES = 4 * 1024**3  # 4 GiB of MP4s on disk
VIDEO_STORE_MAX_AGE_S = 24 * 3600.0
MAX_FINISHED_JOBS = 1000  # older finished jobs are forgotten (their files age out of the store)


class VideoServing:
    """The video job endpoints of one app: the job table, and a task per running job."""

    def __init__(self, client: DiffusionClient, store: OutputStore, admission: Admission,
                 metrics: GatewayMetrics, image_policy: ImageFetchPolicy | None = None) -> None:
        self.client = client
        # How an input_reference given as a URL may be fetched (--allowed-image-domains).
        self.image_policy = image_policy or ImageFetchPolicy()
        self.store = store
        self.admission = admission
        self.metrics = metrics
        self.jobs: OrderedDict[str, VideoJob] = OrderedDict()
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def create(self, body: VideoCreateRequest,
                     input_reference: list[bytes] | None = None) -> dict[str, Any]:
        """Queue a job; with an `input_reference` image (an uploaded file, or the body's
        `input_reference` text or object) the model must be image-to-video."""
        input_reference = list(input_reference or ())
        if body.input_reference is not None:
            if input_reference:
                raise bad_request("give input_reference once: as an uploaded file or as an "
                                  "image URL or data, not both", param="input_reference")
            input_reference.append(await self._load_reference(body.input_reference))
        tasks = (IMAGE_TO_VIDEO, TEXT_TO_VIDEO) if input_reference else (TEXT_TO_VIDEO,
                                                                          IMAGE_TO_VIDEO)
        spec = resolve_model(self.client, body.model, tasks, "/v1/videos")
        width, height = parse_size_param(body.size)
        fps = body.fps or spec.default_fps or 16
        num_frames = self._num_frames(body, spec, fps)
        seed = body.seed if body.seed is not None else random.randrange(MAX_SEED - MAX_OUTPUTS)
        job_id = new_rid("video_")
        req = DiffusionRequest(
            rid=job_id, model=spec.name, prompt=body.prompt,
            negative_prompt=body.negative_prompt, width=width, height=height,
            num_frames=num_frames, fps=fps, num_inference_steps=body.num_inference_steps,
            guidance_scale=body.guidance_scale, seed=seed,
            step_cache=request_step_cache(self.client, body.step_cache),
            reference_images=tuple(input_reference or ()), loras=body.lora,
        )
        try:  # check now, so bad input is a 400 and not a failed job
            resolved = resolve_request(req, spec, StepCacheConfig())
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        job = VideoJob(
            id=job_id, model=spec.name, prompt=body.prompt,
            size=f"{resolved.width}x{resolved.height}", num_frames=resolved.num_frames, fps=fps,
            created_at=int(time.time()), total_steps=resolved.num_inference_steps, seed=seed,
        )
        run = DiffusionRun(self.client, self.admission, self.metrics, req)  # 503 when full
        self.jobs[job_id] = job
        self._forget_old_jobs()
        task = asyncio.create_task(self._run(job, run))
        task.add_done_callback(lambda _: run.close())  # also when cancelled before it started
        self._tasks[job_id] = task
        return job.to_dict()

    async def _load_reference(self, ref: str | ImageReference) -> bytes:
        """The bytes of a textual input_reference; 400 when it names no usable image."""
        param = "input_reference"
        if isinstance(ref, ImageReference):
            if ref.file_id is not None:
                raise bad_request("input_reference.file_id needs a Files API, which this server "
                                  "does not have; send input_reference.image_url (a data URL "
                                  "or an http(s) URL) or upload the image as a file",
                                  param="input_reference.file_id")
            if ref.image_url is None:
                raise bad_request("input_reference needs image_url (a data URL or an http(s) "
                                  "URL)", param="input_reference.image_url")
            ref, param = ref.image_url, "input_reference.image_url"
        try:
            return await load_image_bytes(ref, self.image_policy)
        except ImageInputError as exc:
            raise bad_request(f"input_reference: {exc}", param=param) from None

    @staticmethod
    def _num_frames(body: VideoCreateRequest, spec: ModelSpec, fps: int) -> int | None:
        if body.seconds is not None and body.num_frames is not None:
            raise bad_request("give seconds or num_frames, not both", param="seconds")
        if body.seconds is None:
            return body.num_frames
        # A clip of s seconds spans s*fps intervals; a streaming model's chunks tile it.
        frames = body.seconds * fps + (0 if spec.streaming else 1)
        if abs(frames - round(frames)) > 1e-6 or not spec.frame_count_ok(round(frames)):
            raise bad_request(
                f"seconds={body.seconds:g} at {fps} fps is {frames:g} frames, which model "
                f"{spec.name} cannot make (it needs {spec.frame_rule} frames, at most "
                f"{spec.max_num_frames}); pass num_frames instead", param="seconds")
        return round(frames)

    async def _run(self, job: VideoJob, run: DiffusionRun) -> None:
        try:
            async with contextlib.aclosing(run.events()) as events:
                async for event in events:
                    await self._on_event(job, event)
        except asyncio.CancelledError:
            self._finish(job, CANCELLED)
            raise
        except Exception as exc:  # encoding or storage failed
            logger.exception("video job %s failed", job.id)
            self._finish(job, FAILED, {"code": "500", "message": f"{type(exc).__name__}: {exc}"})
        finally:
            run.close()
            self._tasks.pop(job.id, None)
            if job.status not in FINISHED:
                self._finish(job, FAILED, {"code": "503", "message": "the job ended early"})

    async def _on_event(self, job: VideoJob, event: DiffusionEvent) -> None:
        if isinstance(event, StepEvent):
            job.status = IN_PROGRESS
            job.steps_done, job.total_steps = event.step, event.total_steps
            job.progress = min(99, int(100 * event.step / max(1, event.total_steps)))
        elif isinstance(event, ResultEvent):
            data = await asyncio.to_thread(encode_mp4, event.outputs[0], job.fps)
            await asyncio.to_thread(self.store.put, job.id, data, "mp4")
            job.cached_steps, job.timings = event.cached_steps, event.timings
            self._finish(job, COMPLETED)
            job.progress = 100
        elif event.status == STATUS_CANCELLED:
            self._finish(job, CANCELLED)
        else:
            self._finish(job, FAILED, {"code": str(event.status), "message": event.message})

    @staticmethod
    def _finish(job: VideoJob, status: str, error: dict | None = None) -> None:
        if job.status in FINISHED:
            return
        job.status, job.error, job.completed_at = status, error, int(time.time())

    def _forget_old_jobs(self) -> None:
        finished = [jid for jid, job in self.jobs.items() if job.status in FINISHED]
        for jid in finished[: max(0, len(finished) - MAX_FINISHED_JOBS)]:
            del self.jobs[jid]

    def get(self, job_id: str) -> VideoJob:
        job = self.jobs.get(job_id)
        if job is None:
            raise not_found(f"no video job with id {job_id!r}", param="video_id")
        return job

    def list(self, limit: int = 20, order: str = "desc") -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise bad_request("limit must be between 1 and 100", param="limit")
        if order not in ("asc", "desc"):
            raise bad_request("order must be asc or desc", param="order")
        jobs = list(self.jobs.values())
        if order == "desc":
            jobs.reverse()
        page = [job.to_dict() for job in jobs[:limit]]
        return {"object": "list", "data": page, "has_more": len(jobs) > limit,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None}

    def content(self, job_id: str) -> tuple[Path, str]:
        job = self.get(job_id)
        if job.status != COMPLETED:
            raise APIError(409, f"video {job_id} is {job.status}; its content exists once it is "
                                "completed", param="video_id", code="video_not_ready")
        found = self.store.get(job_id)
        if found is None:
            raise not_found(f"the content of video {job_id} has expired")
        return found

    async def delete(self, job_id: str) -> dict[str, Any]:
        """Cancel a queued/running job (it stops at the next step) or remove a finished one."""
        job = self.get(job_id)
        if job.status not in FINISHED:
            await self.client.cancel(job_id)
            task = self._tasks.get(job_id)
            if task is not None:
                # The worker answers the cancel with ErrorEvent(499); wait for it briefly.
                done, _ = await asyncio.wait({task}, timeout=5.0)
                if not done:
                    task.cancel()
            self._finish(job, CANCELLED)
            return job.to_dict()
        self.jobs.pop(job_id, None)
        self.store.delete(job_id)
        return {"id": job_id, "object": "video.deleted", "deleted": True}

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
