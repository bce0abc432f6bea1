"""Cheap per-step previews: a linear latent -> RGB projection fitted to the model's own VAE.

At first use, a few random latents are decoded with the VAE; the decoded images, average-pooled
to latent resolution, are regressed on the latent channels (least squares, with a bias). A
preview is then one [C] x [C, 3] product per latent pixel, upsampled by repetition: microseconds
instead of a VAE decode, for any family and any checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

_FIT_LATENT_SIZE = 8  # latent pixels per side used for the fit


@dataclass
class LatentPreviewer:
    weight: torch.Tensor  # [C, 3]
    bias: torch.Tensor  # [3]

    @classmethod
    def fit(cls, decode: Callable[[torch.Tensor], torch.Tensor], channels: int,
            device: torch.device, dtype: torch.dtype, seed: int = 0) -> LatentPreviewer:
        """`decode`: [1, C, 1, h, w] latents -> [1, 3, F', H, W] images in [-1, 1]."""
        gen = torch.Generator().manual_seed(seed)
        s = _FIT_LATENT_SIZE
        xs, ys = [], []
        with torch.inference_mode():
            for _ in range(2):
                z = torch.randn(1, channels, 1, s, s, generator=gen)
                img = decode(z.to(device=device, dtype=dtype)).float().cpu()[:, :, 0]  # [1,3,H,W]
                img = F.adaptive_avg_pool2d(img, (s, s))  # [1, 3, s, s]
                xs.append(z[0, :, 0].reshape(channels, -1).T)  # [s*s, C]
                ys.append(img[0].reshape(3, -1).T)  # [s*s, 3]
        x = torch.cat(xs)
        x1 = torch.cat([x, torch.ones(x.shape[0], 1)], dim=1)
        sol = torch.linalg.lstsq(x1, torch.cat(ys)).solution  # [C + 1, 3]
        return cls(weight=sol[:channels], bias=sol[channels])

    def project(self, latents: torch.Tensor, num_frames: int, height: int, width: int
                ) -> np.ndarray:
        """[C, F, h, w] latents -> uint8 [num_frames, height, width, 3]."""
        z = latents.detach().float().cpu()
        rgb = torch.einsum("cfhw,ck->fhwk", z, self.weight) + self.bias  # [F, h, w, 3] in ~[-1,1]
        # Latent frame i covers output frames by nearest index (temporal VAE compression).
        idx = torch.linspace(0, rgb.shape[0] - 1, num_frames).round().long()
        rgb = rgb[idx].permute(0, 3, 1, 2)  # [num_frames, 3, h, w]
        rgb = F.interpolate(rgb, size=(height, width), mode="nearest")
        out = ((rgb.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return out.permute(0, 2, 3, 1).numpy()
