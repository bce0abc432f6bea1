"""FLUX.2 (text-to-image): diffusers `Flux2Pipeline` ([dev], a Mistral Small 3 text encoder)
and `Flux2KleinPipeline` ([klein], a Qwen3 text encoder).

Latents are 2x2-patchified [B, C*4, h/2, w/2], normalized by the VAE's batch-norm running
statistics and packed row-major into tokens [B, (h/2)*(w/2), C*4]; the VAE works at 1/8
resolution, so sizes are multiples of 16. [dev] guides with its distilled guidance embedding
(one transformer call per step). [klein] base guides with true classifier-free guidance, the
transformer running a second time per step on an empty negative prompt the pipeline sets
itself (so no negative_prompt); the step-distilled [klein] checkpoints take no guidance.

Both also edit: reference images (up to `max_reference_images`) are encoded by the VAE and
their tokens appended to the sequence, each at its own offset on the position ids' time axis,
so the prompt can say what to keep of each. The pipeline takes them with its `image` argument
at their own size (it scales one above a megapixel down and crops each to a multiple of 16;
its image processor refuses a side under 64 pixels, which the request validation checks
first), and requests with the same references batch together (their tokens are the same for
every row).

The step cache is cache-dit's DBCache through its registered Flux adapter, which covers
`Flux2Transformer2DModel` (double- and single-stream blocks)."""

from __future__ import annotations

from typing import Any

import torch

from genserve.multimodal_gen.messages import TEXT_TO_IMAGE, ResolvedRequest
from genserve.multimodal_gen.pipelines.base import DiffusionFamily
from genserve.multimodal_gen.pipelines.position_tables import remember_rope


class Flux2Family(DiffusionFamily):
    family = "flux2"
    task = TEXT_TO_IMAGE
    pipeline_classes = ("Flux2Pipeline",)
    max_reference_images = 10  # Black Forest Labs' limit for FLUX.2 [dev]
    references_at_own_size = True
    spec_defaults = dict(
        size_factor=16,
        max_pixels=2048 * 2048,
        default_width=1024,
        default_height=1024,
        default_steps=50,
        default_guidance=4.0,
        max_steps=100,
        supports_negative_prompt=False,
        min_reference_side=64,
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(getattr(self.denoiser, "pos_embed", None), torch.nn.Module):
            remember_rope(self.denoiser.pos_embed)  # the same tables at every step

    def call_kwargs(self, req: ResolvedRequest) -> dict[str, Any]:
        return {"height": req.height, "width": req.width, "guidance_scale": req.guidance_scale}

    def condition_kwargs(self, images, mask, req, rows) -> dict[str, Any]:
        return {"image": list(images)}

    def unpack_latents(self, latents: torch.Tensor, req: ResolvedRequest) -> torch.Tensor:
        if latents.ndim == 5:
            return latents
        # [B, h*w, C] tokens, row-major over the patch grid -> [B, C, 1, h, w]
        h, w = req.height // 16, req.width // 16
        b, _, c = latents.shape
        return latents.permute(0, 2, 1).reshape(b, c, 1, h, w)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        z = latents[:, :, 0]
        mean, std = _bn_statistics(vae, z)
        z = self.pipe._unpatchify_latents(z * std + mean)  # [B, C, h, w] at 1/8 resolution
        return vae.decode(z.to(vae.dtype), return_dict=False)[0].unsqueeze(2)


class Flux2KleinFamily(Flux2Family):
    family = "flux2-klein"
    pipeline_classes = ("Flux2KleinPipeline",)
    max_reference_images = 4  # genserve's cap for the small model: each adds a whole image
    cfg_runs_separately = True

    def checkpoint_defaults(self) -> dict[str, Any]:
        # The step-distilled [klein] checkpoints draw in 4 steps without guidance.
        if getattr(self.pipe.config, "is_distilled", False):
            return {"default_steps": 4, "default_guidance": 1.0}
        return {}

    def _uses_cfg(self, req: ResolvedRequest) -> bool:
        return req.guidance_scale > 1.0 and not getattr(self.pipe.config, "is_distilled", False)

    def unpack_latents(self, latents: torch.Tensor, req: ResolvedRequest) -> torch.Tensor:
        if latents.ndim == 4:
            # The pipeline's final latents come back ready for the VAE ([B, C, h, w], statistics
            # applied): patchify and normalize them again, the form its steps report. In float32,
            # so that decoding undoes it back to the same bf16 / fp16 values.
            z = self.pipe._patchify_latents(latents.float())
            mean, std = _bn_statistics(self.pipe.vae, z)
            return ((z - mean) / std).unsqueeze(2)
        return super().unpack_latents(latents, req)


def _bn_statistics(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's per-channel latent mean and std (batch-norm running statistics), shaped
    [1, C, 1, 1] like `like`."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like)
    return mean, std
