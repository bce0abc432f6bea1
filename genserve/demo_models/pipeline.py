"""The demo models' diffusers pipeline: pixel-space rectified flow with a small DiT.

Components, all stock diffusers / transformers classes so `save_pretrained` / `from_pretrained`
work as for any diffusers folder:
- `tokenizer`: a word-level `PreTrainedTokenizerFast` over the grammar's words (`world.VOCAB`);
- `text_encoder`: a tiny `T5EncoderModel`;
- `transformer`: an `SD3Transformer2DModel` (MMDiT; why: `models.py`) working directly on pixels
  (no VAE). A video's frames are stacked on the channel axis (`in_channels = 3 * num_frames`),
  so one token sees a patch of every frame and motion is learned like any other pattern;
- `scheduler`: `FlowMatchEulerDiscreteScheduler`.

The transformer predicts either the velocity (noise - image; `prediction="velocity"`) or the
clean picture (`prediction="sample"`, both shipped models: a video patch of 16 stacked frames is
768 numbers, more than the token width, so the noise cannot pass through the tokens while a
clean picture, which is simple, can); `predict` turns either into the velocity the scheduler
steps with.

The model draws at its native size (32x32); larger sizes are the native picture upscaled
(bilinear), which `ShapesPipeline.upscale` does after denoising.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
)
from diffusers.utils import BaseOutput
from transformers import PreTrainedTokenizerFast, T5EncoderModel

from genserve.demo_models.models import DEFAULT_GUIDANCE, DEFAULT_STEPS, MAX_PROMPT_TOKENS

PREDICTIONS = ("velocity", "sample")
# x-prediction turns into a velocity by dividing by the noise level: keep it away from zero.
MIN_SIGMA = 0.05


class ShapesPipelineOutput(BaseOutput):
    frames: Any  # images: np [B, H, W, 3] (uint8) for output_type="np"; videos: [B, F, H, W, 3]


class ShapesPipeline(DiffusionPipeline):
    """Text to image (one frame) or text to video (frames stacked on channels) in pixel space."""

    model_cpu_offload_seq = "text_encoder->transformer"
    _callback_tensor_inputs = ["latents"]

    def __init__(self, tokenizer: PreTrainedTokenizerFast, text_encoder: T5EncoderModel,
                 transformer: SD3Transformer2DModel,
                 scheduler: FlowMatchEulerDiscreteScheduler, prediction: str = "velocity"):
        super().__init__()
        if prediction not in PREDICTIONS:
            raise ValueError(f"prediction must be one of {PREDICTIONS}, got {prediction!r}")
        self.register_modules(tokenizer=tokenizer, text_encoder=text_encoder,
                              transformer=transformer, scheduler=scheduler)
        self.register_to_config(prediction=prediction)

    # ---- shapes ----

    @property
    def num_frames(self) -> int:
        return self.transformer.config.in_channels // 3

    @property
    def native_size(self) -> int:
        return self.transformer.config.sample_size

    @property
    def num_timesteps(self) -> int:
        return self._num_timesteps

    @property
    def interrupt(self) -> bool:
        """Set `_interrupt` (from a step callback) to skip the steps left, as diffusers does."""
        return self._interrupt

    # ---- text ----

    def encode_prompt(self, prompts: list[str], device: torch.device,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings [B, L, D], attention mask [B, L]) of `prompts`."""
        toks = self.tokenizer(prompts, padding="max_length", max_length=MAX_PROMPT_TOKENS,
                              truncation=True, return_tensors="pt")
        ids = toks.input_ids.to(device)
        mask = toks.attention_mask.to(device)
        emb = self.text_encoder(ids, attention_mask=mask)[0]
        return emb, mask

    # ---- denoising ----

    def raw_output(self, x: torch.Tensor, sigma: torch.Tensor, emb: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        """What the transformer predicts (see `prediction`) at noise level `sigma` [B]."""
        # MMDiT: the prompt's tokens join the attention, and the whole prompt embedding,
        # flattened (padding zeroed), drives adaLN next to the noise level, so each word of
        # the grammar gets its own weights there.
        pooled = (emb * mask.unsqueeze(-1).to(emb.dtype)).flatten(1)
        return self.transformer(x, encoder_hidden_states=emb, pooled_projections=pooled,
                                timestep=sigma * 1000.0, return_dict=False)[0]

    def predict(self, x: torch.Tensor, sigma: torch.Tensor, emb: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """The velocity (noise - image) at noise level `sigma` [B] in [0, 1]."""
        out = self.raw_output(x, sigma, emb, mask)
        if self.config.prediction == "sample":
            s = sigma.clamp(min=MIN_SIGMA).view(-1, *([1] * (x.ndim - 1))).to(out.dtype)
            return (x - out) / s
        return out

    def upscale(self, pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """[B, 3F, s, s] native pixels in [-1, 1] -> [B, 3, F, height, width]."""
        b, c, s, _ = pixels.shape
        if (height, width) != (s, s):
            pixels = torch.nn.functional.interpolate(
                pixels.float(), size=(height, width), mode="bilinear", align_corners=False,
                antialias=False).to(pixels.dtype)
        return pixels.view(b, c // 3, 3, height, width).transpose(1, 2).clamp(-1, 1)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_frames: int | None = None,
        num_inference_steps: int = DEFAULT_STEPS,
        guidance_scale: float | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "np",
        return_dict: bool = True,
        callback_on_step_end: Any = None,
        callback_on_step_end_tensor_inputs: list[str] | None = None,
    ):
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        batch = len(prompts)
        if negative_prompt is None:
            negatives = [""] * batch
        elif isinstance(negative_prompt, str):
            negatives = [negative_prompt] * batch
        else:
            negatives = list(negative_prompt)
        if len(negatives) != batch:
            raise ValueError(f"{len(negatives)} negative prompts for {batch} prompts")
        size = self.native_size
        height = height or size
        width = width or size
        if num_frames is not None and num_frames != self.num_frames:
            raise ValueError(f"this model makes exactly {self.num_frames} frame(s), "
                             f"not {num_frames}")
        tensor_names = callback_on_step_end_tensor_inputs or []
        unknown = set(tensor_names) - set(self._callback_tensor_inputs)
        if unknown:
            raise ValueError(f"callback tensor inputs {sorted(unknown)} are not offered; "
                             f"choose from {self._callback_tensor_inputs}")
        if guidance_scale is None:
            guidance_scale = DEFAULT_GUIDANCE["video" if self.num_frames > 1 else "image"]
        device = self._execution_device
        dtype = self.transformer.dtype
        use_cfg = guidance_scale > 1.0

        emb, mask = self.encode_prompt(prompts, device)
        if use_cfg:
            neg_emb, neg_mask = self.encode_prompt(negatives, device)
            emb, mask = torch.cat([neg_emb, emb]), torch.cat([neg_mask, mask])
        emb = emb.to(dtype)

        shape = (batch, 3 * self.num_frames, size, size)
        if latents is None:
            latents = _noise(shape, generator, device, dtype)
        self.scheduler.set_timesteps(num_inference_steps, device=device)
        timesteps = self.scheduler.timesteps
        self._num_timesteps = len(timesteps)
        self._interrupt = False
        for i, t in enumerate(self.progress_bar(timesteps)):
            if self.interrupt:
                continue
            x = torch.cat([latents, latents]) if use_cfg else latents
            sigma = (t / 1000.0).expand(x.shape[0]).to(dtype)
            v = self.predict(x, sigma, emb, mask)
            if use_cfg:
                v_neg, v_pos = v.chunk(2)
                v = v_neg + guidance_scale * (v_pos - v_neg)
            latents = self.scheduler.step(v, t, latents, return_dict=False)[0]
            if callback_on_step_end is not None:
                tensors = {"latents": latents} if tensor_names else {}
                out = callback_on_step_end(self, i, t, tensors) or {}
                latents = out.get("latents", latents)

        if output_type == "latent":
            result = latents
        else:
            pixels = self.upscale(latents, height, width)  # [B, 3, F, H, W]
            arr = ((pixels.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
            arr = arr.permute(0, 2, 3, 4, 1).cpu().numpy()  # [B, F, H, W, 3]
            result = arr[:, 0] if self.num_frames == 1 else arr
            if output_type == "pil":
                from PIL import Image

                result = [Image.fromarray(a) for a in result] if self.num_frames == 1 else \
                    [[Image.fromarray(f) for f in clip] for clip in result]
            elif output_type != "np":
                raise ValueError(f"output_type must be np, pil or latent, got {output_type!r}")
        self.maybe_free_model_hooks()
        if not return_dict:
            return (result,)
        return ShapesPipelineOutput(frames=result)


class ShapesImagePipeline(ShapesPipeline):
    """The demo text-to-image model (`shapes-image`)."""


class ShapesVideoPipeline(ShapesPipeline):
    """The demo text-to-video model (`shapes-video`)."""


def _noise(shape: tuple[int, ...], generator: Any, device: torch.device,
           dtype: torch.dtype) -> torch.Tensor:
    """Initial noise; one generator per row keeps a row's noise independent of its batch."""
    if isinstance(generator, list):
        if len(generator) != shape[0]:
            raise ValueError(f"{len(generator)} generators for a batch of {shape[0]}")
        rows = [torch.randn(shape[1:], generator=g, device=g.device, dtype=torch.float32)
                for g in generator]
        x = torch.stack(rows)
    else:
        gen_device = generator.device if generator is not None else device
        x = torch.randn(shape, generator=generator, device=gen_device, dtype=torch.float32)
    return x.to(device=device, dtype=dtype)
