"""Helios: autoregressive video with history (diffusers `HeliosPipeline`).

Helios makes a video chunk by chunk. Each chunk of `latents_per_chunk` latent frames is denoised
conditioned on the latents of the chunks before it (a long, a mid and a short window of
`history_sizes` frames, patchified at 4x, 2x and 1x) and on the video's first latent frame.
diffusers runs every chunk of a video inside one `__call__`; this family runs the same chunk
loop one chunk at a time, keeping what the next chunk needs in a `HeliosStream`, so that:

- a realtime session is one continuous video: its stream lives in the worker between chunks;
- a REST request (`/v1/videos`, a whole number of chunks) runs its chunks in one call;
- chunks of several streams at different points of their videos share one transformer call
  (the history windows have a fixed size, zero-filled at the start, so every row has the same
  shape).

The components and the transformer are diffusers' own; the chunk loop follows
`HeliosPipeline.__call__` operation for operation (text-to-video, `keep_first_frame`), so the
frames equal diffusers' for the same seed. The VAE decodes each chunk on its own, as diffusers
does, so it keeps no state between chunks. Runs in the worker process (imports torch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from genserve.multimodal_gen.messages import TEXT_TO_VIDEO, ResolvedRequest, StepDecision
from genserve.multimodal_gen.pipelines.base import BatchOutput, DiffusionFamily, StepHook

# diffusers' defaults for the Helios checkpoints (HeliosPipeline.__call__).
HISTORY_SIZES = (16, 2, 1)
LATENTS_PER_CHUNK = 9
MAX_SEQUENCE_LENGTH = 512


@dataclass
class HeliosStream:
    """What the next chunk of one video needs. `history` keeps the last sum(history_sizes)
    latent frames (zeros before the video has that many); `prefix` is the video's first latent
    frame once the first chunk is made."""

    generator: torch.Generator
    history: torch.Tensor  # [1, C, sum(history_sizes), h, w] float32
    prefix: torch.Tensor | None = None  # [1, C, 1, h, w] float32
    prompt: str | None = None  # the prompt `embeds` encode
    negative_prompt: str | None = None
    embeds: torch.Tensor | None = None  # [1, L, D]
    negative_embeds: torch.Tensor | None = None  # [1, L, D] with guidance, else None
    chunks: int = 0  # chunks made so far
    _saved_rng: torch.Tensor | None = field(default=None, repr=False)

    def nbytes(self) -> int:
        tensors = (self.history, self.prefix, self.embeds, self.negative_embeds)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def begin_chunk(self) -> None:
        # A chunk that is stopped (cancel, regroup) must leave the stream as it was, so the
        # re-run draws the same noise.
        self._saved_rng = self.generator.get_state()

    def abandon_chunk(self) -> None:
        if self._saved_rng is not None:
            self.generator.set_state(self._saved_rng)
            self._saved_rng = None


class HeliosFamily(DiffusionFamily):
    family = "helios"
    task = TEXT_TO_VIDEO
    pipeline_classes = ("HeliosPipeline",)
    cfg_runs_separately = True
    step_cache_kind = "none"  # cache-dit has no adapter for the history-conditioned blocks
    streaming = True
    history_sizes: tuple[int, ...] = HISTORY_SIZES
    latents_per_chunk: int = LATENTS_PER_CHUNK
    spec_defaults = dict(
        size_factor=16, max_pixels=1280 * 720, default_width=640, default_height=384,
        default_steps=50, default_guidance=5.0, max_steps=100, default_fps=24,
    )

    def __init__(self, name: str, pipe: Any, source: str, spec_overrides: dict | None = None):
        self.pipe = pipe  # chunk_frames reads the VAE before the spec is built
        frames = self.chunk_frames
        chunked = dict(streaming=True, default_num_frames=frames, frame_rule=f"{frames}k+0",
                       max_num_frames=frames * 16)
        super().__init__(name, pipe, source, {**chunked, **(spec_overrides or {})})
        if self.device.type == "cpu" and getattr(pipe, "vae", None) is not None:
            channels_last_conv3d(pipe.vae)

    @property
    def chunk_frames(self) -> int:
        """Frames one chunk decodes to: the VAE's first latent frame makes one, each other
        `temporal` frames."""
        temporal = self.pipe.vae.config.scale_factor_temporal
        return (self.latents_per_chunk - 1) * temporal + 1

    # ---- DiffusionFamily pieces (previews decode through `decode`) ----

    def call_kwargs(self, req: ResolvedRequest) -> dict[str, Any]:
        return {}

    def unpack_latents(self, latents: torch.Tensor, req: ResolvedRequest) -> torch.Tensor:
        return latents  # already [B, C, F, h, w]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        c = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(latents.device,
                                                                            vae.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(
            latents.device, vae.dtype)
        # The same operations as diffusers (divide by 1/std), so the pixels match.
        return vae.decode(latents.to(vae.dtype) / inv_std + mean, return_dict=False)[0]

    def decode_chunk(self, latents: torch.Tensor, head: ResolvedRequest,
                     streams: list[HeliosStream] | None = None) -> torch.Tensor:
        """Pixels [B, 3, F, H, W] in [-1, 1] of a chunk's latents for `head`'s size; `streams`
        are the rows' streams (a family that draws each stream in a frame of its own places
        the pixels by them)."""
        return self.decode(latents)

    def row_tensors(self, streams: list[HeliosStream]) -> dict[str, torch.Tensor]:
        """Per-row tensors, besides the latents, that a step's preview decodes with (the
        worker hands `preview` each row's slice)."""
        return {}

    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, embeds: torch.Tensor,
                 history: dict[str, torch.Tensor]) -> torch.Tensor:
        """What the scheduler steps with; the Helios checkpoints predict it directly."""
        return self.denoiser(hidden_states=latents, timestep=timestep,
                             encoder_hidden_states=embeds, return_dict=False, **history)[0]

    # ---- streams ----

    def new_stream(self, seed: int, width: int, height: int) -> HeliosStream:
        """A stream at the start of a video: seeded noise, an empty (zero) history."""
        gen_device = "cpu" if self.device.type == "mps" else self.device
        scale = self.pipe.vae_scale_factor_spatial
        history = torch.zeros(
            1, self.denoiser.config.in_channels, sum(self.history_sizes), height // scale,
            width // scale, device=self.device, dtype=torch.float32)
        return HeliosStream(torch.Generator(device=gen_device).manual_seed(seed), history)

    # ---- the run ----

    def generate(self, batch: list[ResolvedRequest], on_step: StepHook | None = None,
                 decode: bool = True, streams: list[HeliosStream] | None = None) -> BatchOutput:
        """Run `batch` (same batch_key). With `streams` (one per row, each request one
        output), each row makes the next chunk of its stream; without, each row makes a whole
        video of num_frames / chunk_frames chunks from a new stream. Steps are reported
        cumulatively over the chunks; a decision other than CONTINUE ends the call there with
        no frames, the streams as they were before the chunk."""
        if on_step is None:
            on_step = _every_step
        t0 = time.perf_counter()
        head = batch[0]
        rows = [(req, seed) for req in batch for seed in req.seeds]
        if streams is None:
            streams = [self.new_stream(seed, head.width, head.height) for _, seed in rows]
            num_chunks = head.num_frames // self.chunk_frames
        else:
            num_chunks = 1
        if len(streams) != len(rows):
            raise ValueError(f"{len(rows)} rows but {len(streams)} streams")
        self.step_cache.configure(head.step_cache, head.num_inference_steps, separate_cfg=True)
        per_chunk = self.steps_per_chunk(head)
        self._total_steps = num_chunks * per_chunk
        chunks: list[list[np.ndarray]] = [[] for _ in rows]
        decode_ms = 0.0
        for k in range(num_chunks):
            try:
                latents, decision = self._run_chunk(streams, rows, head, on_step,
                                                    k * per_chunk)
            except BaseException:
                self._abandon(streams)  # a failed chunk leaves no trace
                raise
            if decision is not StepDecision.CONTINUE:
                self._abandon(streams)
                return BatchOutput([], 0, self._total_steps, {}, decision=decision)
            t = time.perf_counter()
            if decode:
                # One VAE call for every row: its per-frame causal loop costs about the same
                # for one row as for several (pixels within one level of decoding alone).
                with torch.inference_mode():
                    images = self.decode_chunk(latents, head, streams)
                for i in range(len(rows)):
                    chunks[i].append(self._to_uint8(images[i : i + 1]))
            decode_ms += (time.perf_counter() - t) * 1e3
        frames = [np.concatenate(parts) for parts in chunks] if decode else []
        total_ms = (time.perf_counter() - t0) * 1e3
        return BatchOutput(frames=frames, cached_steps=0, total_steps=self._total_steps,
                           timings={"denoise": total_ms - decode_ms, "decode": decode_ms})

    def _encode(self, stream: HeliosStream, prompt: str, negative: str | None,
                cfg: bool) -> None:
        # A new prompt (or a new stream) is encoded once; later chunks reuse the embeddings.
        if stream.embeds is not None and stream.prompt == prompt and (
                not cfg or (stream.negative_embeds is not None
                            and stream.negative_prompt == negative)):
            return
        embeds, negative_embeds = self.pipe.encode_prompt(
            prompt=prompt, negative_prompt=negative, do_classifier_free_guidance=cfg,
            max_sequence_length=MAX_SEQUENCE_LENGTH, device=self.device)
        dtype = self.denoiser.dtype
        stream.embeds = embeds.to(dtype)
        stream.negative_embeds = negative_embeds.to(dtype) if cfg else None
        stream.prompt, stream.negative_prompt = prompt, negative

    def steps_per_chunk(self, head: ResolvedRequest) -> int:
        """Denoising steps one chunk takes (progress counts these over the chunks)."""
        return head.num_inference_steps

    def _conditioning(self, streams: list[HeliosStream],
                      rows: list[tuple[ResolvedRequest, int]], cfg: bool
                      ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """Prompt embeddings (re-encoded only where the prompt changed), negative embeddings
        with guidance, and the history windows (long, mid, 1x) with their indices, batched
        over the rows. The short window leads with the video's first latent frame (zeros
        until the first chunk is made). Call under inference_mode."""
        dtype = self.denoiser.dtype
        for stream, (req, _) in zip(streams, rows):
            self._encode(stream, req.prompt, req.negative_prompt, cfg)
        embeds = torch.cat([s.embeds for s in streams])
        negative_embeds = torch.cat([s.negative_embeds for s in streams]) if cfg else None
        sizes = list(self.history_sizes)
        long, mid, short = [], [], []
        for s in streams:
            h_long, h_mid, h_1x = s.history.split(sizes, dim=2)
            prefix = s.prefix if s.prefix is not None else torch.zeros_like(h_1x[:, :, :1])
            long.append(h_long)
            mid.append(h_mid)
            short.append(torch.cat([prefix, h_1x], dim=2))
        history = {"latents_history_long": torch.cat(long).to(dtype),
                   "latents_history_mid": torch.cat(mid).to(dtype),
                   "latents_history_short": torch.cat(short).to(dtype)}
        history.update(self._indices(len(streams)))
        return embeds, negative_embeds, history

    def _chunk_noise(self, streams: list[HeliosStream]) -> torch.Tensor:
        """This chunk's starting noise, from each row's own generator (whose state is saved
        first, so a stopped chunk can put it back). [B, C, n, h, w] float32."""
        from diffusers.utils.torch_utils import randn_tensor

        for s in streams:
            s.begin_chunk()
        _, c, _, h, w = streams[0].history.shape  # the latent channels the history holds
        return torch.cat([
            randn_tensor((1, c, self.latents_per_chunk, h, w), generator=s.generator,
                         device=self.device, dtype=torch.float32) for s in streams])

    def _advance(self, streams: list[HeliosStream], latents: torch.Tensor) -> None:
        """The chunk becomes history; the first chunk's first frame becomes the prefix."""
        n_history = sum(self.history_sizes)
        for row, s in enumerate(streams):
            made = latents[row : row + 1]
            if s.prefix is None:
                s.prefix = made[:, :, 0:1].clone()
            s.history = torch.cat([s.history, made], dim=2)[:, :, -n_history:].clone()
            s.chunks += 1
            s._saved_rng = None

    def _run_chunk(self, streams: list[HeliosStream], rows: list[tuple[ResolvedRequest, int]],
                   head: ResolvedRequest, on_step: StepHook, steps_before: int
                   ) -> tuple[torch.Tensor | None, StepDecision]:
        """Denoise the next chunk of every stream as one batch: (latents [B, C, n, h, w],
        CONTINUE) with the streams advanced, or (None, the hook's decision) when it stops."""
        from diffusers.pipelines.helios.pipeline_helios import calculate_shift

        pipe, transformer = self.pipe, self.denoiser
        dtype, device = transformer.dtype, self.device
        cfg = head.guidance_scale > 1.0
        with torch.inference_mode():
            embeds, negative_embeds, history = self._conditioning(streams, rows, cfg)
            latents = self._chunk_noise(streams)
            # The step schedule (the same for every chunk of this size).
            steps = head.num_inference_steps
            _, _, _, h, w = latents.shape
            p_t, p_h, p_w = transformer.config.patch_size
            seq_len = self.latents_per_chunk * h * w // (p_t * p_h * p_w)
            config = pipe.scheduler.config
            mu = calculate_shift(seq_len, config.get("base_image_seq_len", 256),
                                 config.get("max_image_seq_len", 4096),
                                 config.get("base_shift", 0.5), config.get("max_shift", 1.15))
            sigmas = np.linspace(0.999, 0.0, steps + 1)[:-1]
            pipe.scheduler.set_timesteps(steps, device=device, sigmas=sigmas, mu=mu)
        decision = on_step(steps_before, self._total_steps, {})
        if decision is not StepDecision.CONTINUE:
            return None, decision
        for i, t in enumerate(pipe.scheduler.timesteps):
            with torch.inference_mode():
                timestep = t.expand(latents.shape[0])
                x = latents.to(dtype)
                with transformer.cache_context("cond"):
                    noise = self.velocity(x, timestep, embeds, history)
                if cfg:
                    with transformer.cache_context("uncond"):
                        uncond = self.velocity(x, timestep, negative_embeds, history)
                    noise = uncond + head.guidance_scale * (noise - uncond)
                latents = pipe.scheduler.step(noise, t, latents, return_dict=False)[0]
            decision = on_step(steps_before + i + 1, self._total_steps,
                               {"latents": latents, **self.row_tensors(streams)})
            if decision is not StepDecision.CONTINUE:
                return None, decision
        self._advance(streams, latents)
        return latents, StepDecision.CONTINUE

    def _indices(self, batch: int) -> dict[str, torch.Tensor]:
        """Frame positions of the prefix, the history windows and the chunk (as diffusers lays
        them out with keep_first_frame)."""
        sizes = [1, *self.history_sizes, self.latents_per_chunk]
        prefix, long, mid, one, chunk = torch.arange(sum(sizes)).split(sizes)
        short = torch.cat([prefix, one])
        return {"indices_hidden_states": chunk.unsqueeze(0),
                "indices_latents_history_short": short.unsqueeze(0),
                "indices_latents_history_mid": mid.unsqueeze(0),
                "indices_latents_history_long": long.unsqueeze(0)}

    @staticmethod
    def _abandon(streams: list[HeliosStream]) -> None:
        for s in streams:
            s.abandon_chunk()


def channels_last_conv3d(vae: torch.nn.Module) -> None:
    """Store the 3D convolution weights channels-last on a CPU: oneDNN then runs the VAE's
    batched decode (several streams' chunks at once) on its fast path instead of the slow
    reference convolution (docs/benchmarks.md). Sums change order only: a pixel may move one
    level."""
    for module in vae.modules():
        if isinstance(module, torch.nn.Conv3d):
            module.weight.data = module.weight.data.contiguous(
                memory_format=torch.channels_last_3d)


def _every_step(step: int, total: int, tensors: dict) -> StepDecision:
    return StepDecision.CONTINUE
