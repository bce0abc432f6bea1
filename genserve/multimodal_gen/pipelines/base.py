"""The base of every diffusion pipeline family: run one batch of same-shape requests through a
diffusers pipeline, reporting each step, and decode each output on its own.

Each request row gets its own `torch.Generator` seeded with its seed, so its initial noise does
not depend on its neighbours; the VAE decodes one output at a time because batched convolutions
on CPU are not bit-identical to unbatched ones. Together this makes a request's pixels the same
whether it ran alone or batched. Runs in the worker process (imports torch).
"""

from __future__ import annotations

import io
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from genserve.multimodal_gen.batch_invariance import make_batch_invariant
from genserve.multimodal_gen.messages import ModelSpec, ResolvedRequest, StepDecision
from genserve.multimodal_gen.pipelines.position_tables import remember_relative_bias
from genserve.multimodal_gen.step_cache import ExpertStepCaches, StepCache, make_step_cache

# on_step(step, total, tensors) -> StepDecision: step 0 before the first denoising step (tensors
# empty), then after each step 1..total with tensors = {"latents": [B, C, F, h, w]}. Any decision
# but CONTINUE leaves the pipeline call there (cancellation, regrouping).
StepHook = Callable[[int, int, dict[str, torch.Tensor]], StepDecision]


@dataclass
class BatchOutput:
    """What one pipeline call produced, rows in request order (request i owns its num_outputs)."""

    frames: list[np.ndarray]  # per row: uint8 [F, H, W, 3]
    cached_steps: int
    total_steps: int
    timings: dict[str, float]  # ms
    # What ended the call: CONTINUE when every step ran; otherwise the step hook's decision that
    # left it early, and there are no frames.
    decision: StepDecision = StepDecision.CONTINUE


class DiffusionFamily(ABC):
    """One supported diffusers pipeline family. Subclasses set the class attributes and say how
    to call their pipeline, unpack its latents and decode them."""

    family: ClassVar[str]
    task: ClassVar[str]
    pipeline_classes: ClassVar[tuple[str, ...]]  # model_index.json `_class_name` values
    img2img_class: ClassVar[str | None] = None  # diffusers class sharing the same components
    max_reference_images: ClassVar[int] = 0  # image-conditioned tasks: images per request
    # The pipeline takes reference images at their own size (it sizes them itself); else
    # they are resized to the output size first.
    references_at_own_size: ClassVar[bool] = False
    spec_defaults: ClassVar[dict[str, Any]]  # ModelSpec fields for a real checkpoint
    cfg_runs_separately: ClassVar[bool] = False  # transformer called twice per step with CFG
    step_cache_kind: ClassVar[str] = "dbcache"  # a key of step_cache.STEP_CACHES
    # (blocks attribute, cache-dit ForwardPattern) when cache-dit has no adapter of its own.
    cache_blocks: ClassVar[tuple[str, str] | None] = None
    # The denoiser can be split over several devices (--diffusion-cp, context_parallel.py):
    # cache-dit has a context-parallel plan for it and its sequences keep a fixed length.
    context_parallel: ClassVar[bool] = False

    def __init__(self, name: str, pipe: Any, source: str, spec_overrides: dict | None = None):
        self.name = name
        self.pipe = pipe
        self.spec = ModelSpec(
            name=name,
            task=self.task,
            family=self.family,
            source=source,
            supports_image_to_image=self.img2img_class is not None,
            max_reference_images=self.max_reference_images,
            step_cache=self.step_cache_kind != "none",
            scheduler=scheduler_summary(getattr(pipe, "scheduler", None)),
            **{**self.spec_defaults, **self.checkpoint_defaults(), **(spec_overrides or {})},
        )
        # Before the step cache: cache-dit wraps the denoiser's forward, we wrap its layers.
        for denoiser in self.denoisers:
            make_batch_invariant(denoiser)
        encoder = getattr(getattr(pipe, "vae", None), "encoder", None)
        if self.max_reference_images and isinstance(encoder, torch.nn.Module):
            make_batch_invariant(encoder)  # reference images may be encoded once per row
        channels_last_vae(getattr(pipe, "vae", None))
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module) and component not in self.denoisers:
                remember_relative_bias(component)  # T5 / UMT5 text encoders
        caches = [make_step_cache(self.step_cache_kind, d, self.cache_blocks)
                  for d in self.denoisers]
        self.step_cache: StepCache = (caches[0] if len(caches) == 1
                                      else ExpertStepCaches(caches, self.expert_steps))
        self.lora_adapters: tuple[str, ...] = ()  # loaded adapters (pipelines/lora.py)
        self.active_loras: tuple[tuple[str, float], ...] = ()
        self._img2img: Any = None
        self._device: torch.device | None = None
        self._previewer: Any = None

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def denoisers(self) -> tuple[torch.nn.Module, ...]:
        """Every denoiser the pipeline calls: `denoiser`, then the low-noise expert of a
        two-expert pipeline (Wan 2.2 A14B's `transformer_2`, switched to by timestep)."""
        second = getattr(self.pipe, "transformer_2", None)
        return (self.denoiser,) if second is None else (self.denoiser, second)

    @property
    def device(self) -> torch.device:
        if self._device is None:  # walks every module: look it up once
            self._device = self.pipe._execution_device
        return self._device

    # ---- per-family pieces ----

    def expert_steps(self, num_inference_steps: int) -> tuple[int, ...]:
        """How many of `num_inference_steps` steps each of `denoisers` runs (a two-expert
        family overrides it)."""
        return (num_inference_steps,)

    def checkpoint_defaults(self) -> dict[str, Any]:
        """ModelSpec defaults this checkpoint's own config implies (a distilled model's step
        count and guidance), over the family's `spec_defaults`."""
        return {}

    @abstractmethod
    def call_kwargs(self, req: ResolvedRequest) -> dict[str, Any]:
        """Shape/guidance arguments of the diffusers `__call__` for this batch (same for all)."""

    def condition_kwargs(self, images: list[Any], mask: Any | None, req: ResolvedRequest,
                         rows: int) -> dict[str, Any]:
        """`__call__` arguments for a request's reference images (PIL, resized to the output
        size) and mask (PIL "L"), the same for all `rows` rows of the call. Image-conditioned
        families override it."""
        raise ValueError(f"model {self.name} takes no reference image")

    @abstractmethod
    def unpack_latents(self, latents: torch.Tensor, req: ResolvedRequest) -> torch.Tensor:
        """The pipeline's working latents -> [B, C, F, h, w]."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[1, C, F, h, w] unpacked latents -> images in [-1, 1], [1, 3, F, H, W]."""

    def after_parallelize(self) -> None:
        """Called once cache-dit has split the denoiser over the group (context_parallel.py):
        what a family mends for the parts of its pipeline that were not split."""
        return None

    def cp_sequence_lengths(self, kwargs: dict[str, Any]) -> dict[str, int]:
        """The token sequences of one denoiser call (its keyword arguments) that context
        parallelism splits over the ranks: name -> length."""
        # Packed latents [B, tokens, C] and prompt embeddings [B, tokens, D].
        names = {"hidden_states": "latent", "encoder_hidden_states": "prompt"}
        return {label: kwargs[name].shape[1] for name, label in names.items()
                if isinstance(kwargs.get(name), torch.Tensor)}

    # ---- the run ----

    def generate(self, batch: list[ResolvedRequest], on_step: StepHook | None = None,
                 decode: bool = True) -> BatchOutput:
        """Run `batch` (same batch_key) as one pipeline call, asking `on_step` at each step
        whether to go on (without it, every step runs). `decode=False` (the other ranks of a
        context-parallel group) stops at the latents: no frames."""
        t0 = time.perf_counter()
        head = batch[0]
        # 1. One row per output: its prompt, negative prompt and seeded generator.
        prompts, negatives, generators = self._rows(batch)
        if head.loras or self.active_loras:
            from genserve.multimodal_gen.pipelines.lora import activate

            activate(self, head.loras)
        # 2. Switch to this batch's LoRA adapters (the same for every request of a batch),
        # and refresh the step cache for this call's config and step count.
        self.step_cache.configure(head.step_cache, head.num_inference_steps,
                                  separate_cfg=self.cfg_runs_separately and self._uses_cfg(head))
        # 3. Denoise to latents, reporting each step.
        latents, decision = self._denoise(head, prompts, negatives, generators, on_step)
        t1 = time.perf_counter()
        cached = self.step_cache.cached_steps()
        # 4. Decode each row on its own (bit-identical whatever the batch size).
        with torch.inference_mode():
            finished = decode and decision is StepDecision.CONTINUE
            rows = range(latents.shape[0]) if finished else range(0)
            frames = [self._to_uint8(self.decode(self.unpack_latents(latents[i : i + 1], head)))
                      for i in rows]
        t2 = time.perf_counter()
        return BatchOutput(
            frames=frames,
            cached_steps=cached,
            total_steps=self._total_steps,
            timings={"denoise": (t1 - t0) * 1e3, "decode": (t2 - t1) * 1e3},
            decision=decision,
        )

    def _uses_cfg(self, req: ResolvedRequest) -> bool:
        return req.guidance_scale > 1.0

    def _rows(self, batch: list[ResolvedRequest]):
        prompts, negatives, generators = [], [], []
        gen_device = "cpu" if self.device.type == "mps" else self.device
        for req in batch:
            for seed in req.seeds:
                prompts.append(req.prompt)
                negatives.append(req.negative_prompt or "")
                generators.append(torch.Generator(device=gen_device).manual_seed(seed))
        return prompts, negatives, generators

    def _denoise(self, head, prompts, negatives, generators,
                 on_step: StepHook | None) -> tuple[torch.Tensor, StepDecision]:
        pipe = self.pipe
        kwargs = self.call_kwargs(head)
        if head.init_image is not None:
            pipe = self._img2img_pipeline()
            image = _load_image(head.init_image, head.width, head.height)
            kwargs.update(image=[image] * len(prompts), strength=head.strength)
        if head.reference_images:
            size = (None, None) if self.references_at_own_size else (head.width, head.height)
            images = [_load_image(data, *size) for data in head.reference_images]
            mask = None
            if head.mask_image is not None:
                mask = _load_image(head.mask_image, head.width, head.height, mode="L")
            kwargs.update(self.condition_kwargs(images, mask, head, len(prompts)))
        if self.spec.supports_negative_prompt and any(negatives):
            kwargs["negative_prompt"] = negatives

        decision = StepDecision.CONTINUE
        started = False

        def decide(step: int, total: int, tensors: dict[str, torch.Tensor]) -> None:
            nonlocal decision
            if on_step is None:
                return
            decision = on_step(step, total, tensors)
            if decision is not StepDecision.CONTINUE:
                # diffusers reads the flag at the top of each step: the steps left are skipped
                # (no callback either) and the call returns its latents as they are.
                pipe._interrupt = True

        def callback(pipe_: Any, i: int, t: Any, tensors: dict[str, torch.Tensor]) -> dict:
            self._total_steps = pipe_.num_timesteps
            decide(i + 1, pipe_.num_timesteps,
                   {"latents": self.unpack_latents(tensors["latents"], head)})
            return {}

        def open_step_loop(iterable: Any = None, total: Any = None) -> Any:
            # Step 0. A diffusers pipeline opens its progress bar once it has encoded the prompts
            # and prepared the latents, just before its loop first reads `interrupt`: a cancel,
            # or a regroup with requests that arrived meanwhile, costs no denoising step here.
            nonlocal started
            if not started:
                started = True
                decide(0, getattr(pipe, "num_timesteps", None) or head.num_inference_steps, {})
            return type(pipe).progress_bar(pipe, iterable, total)

        self._total_steps = head.num_inference_steps
        # For this call only, on this instance: the class's own progress bar serves the rest.
        pipe.progress_bar = open_step_loop
        try:
            with torch.inference_mode():
                out = self._call_pipeline(pipe, callback, prompt=prompts,
                                          num_inference_steps=head.num_inference_steps,
                                          generator=generators, output_type="latent",
                                          return_dict=False, **kwargs)
        finally:
            del pipe.progress_bar
        return out[0], decision

    def _call_pipeline(self, pipe: Any, callback: Callable, **kwargs: Any) -> Any:
        """Call `pipe` with `kwargs`, `callback(pipe, i, t, {"latents": ...})` after each step.
        A pipeline without diffusers' step-end callback overrides this."""
        return pipe(callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["latents"],
                    **kwargs)

    def _img2img_pipeline(self) -> Any:
        if self._img2img is None:
            import diffusers

            cls = getattr(diffusers, self.img2img_class)
            expected = set(cls._get_signature_keys(cls)[0])
            parts = {k: v for k, v in self.pipe.components.items() if k in expected}
            self._img2img = cls(**parts)
            self._img2img.set_progress_bar_config(disable=True)
        return self._img2img

    @staticmethod
    def _to_uint8(images: torch.Tensor) -> np.ndarray:
        # [1, 3, F, H, W] in [-1, 1] -> uint8 [F, H, W, 3]
        x = ((images[0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return x.permute(1, 2, 3, 0).cpu().numpy()

    def preview(self, tensors: dict[str, torch.Tensor], req: ResolvedRequest,
                full_decode: bool) -> np.ndarray:
        """uint8 [num_frames, H, W, 3] of row 0: a full VAE decode or the cheap projection."""
        latents = tensors["latents"][:1]
        if full_decode:
            with torch.inference_mode():
                return self._to_uint8(self.decode(latents))
        from genserve.multimodal_gen.previews import LatentPreviewer

        if self._previewer is None:
            self._previewer = LatentPreviewer.fit(self.decode, latents.shape[1], self.device,
                                                  self.denoiser.dtype)
        return self._previewer.project(latents[0], req.num_frames, req.height, req.width)


# Scheduler config entries that change how steps are spaced or what the model predicts.
_SCHEDULER_KEYS = ("shift", "use_dynamic_shifting", "timestep_spacing", "prediction_type",
                   "beta_schedule", "flow_shift", "time_shift_type")


def scheduler_summary(scheduler: Any) -> tuple[tuple[str, Any], ...]:
    """(name, value) pairs of the checkpoint's scheduler, for /v1/models: its class and the
    config entries above that it sets."""
    if scheduler is None:
        return ()
    config = getattr(scheduler, "config", {})
    pairs = [("class", type(scheduler).__name__)]
    pairs += [(k, config[k]) for k in _SCHEDULER_KEYS
              if k in config and isinstance(config[k], str | int | float | bool)]
    return tuple(pairs)


def channels_last_vae(vae: torch.nn.Module | None) -> bool:
    """Keep a 2D VAE's weights channels-last, so its convolutions take the NHWC path of oneDNN
    (CPU) and cuDNN (GPU), their faster layout for these convolutions (docs/benchmarks.md). The
    sums are the same up to their order, so a pixel can come out one level apart. Video VAEs
    (3D convolutions) and MPS keep their layout. True when applied."""
    if vae is None:
        return False
    convs = [m for m in vae.modules() if isinstance(m, torch.nn.modules.conv._ConvNd)]
    if not convs or not all(type(m) is torch.nn.Conv2d for m in convs):
        return False
    if any(p.device.type == "mps" for p in vae.parameters()):
        return False
    vae.to(memory_format=torch.channels_last)
    return True


def _load_image(data: bytes, width: int | None, height: int | None, mode: str = "RGB"):
    """The picture in `mode`, resized to width x height (None: kept at its own size)."""
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert(mode)
    if width is not None and image.size != (width, height):
        # A mask stays black and white: nearest, not a blend of both.
        resample = Image.NEAREST if mode == "L" else Image.LANCZOS
        image = image.resize((width, height), resample)
    return image
