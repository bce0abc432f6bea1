"""Drawing the torus world of `shapes-stream` in a frame that follows its shape.

The world wraps around at every border, so rolling all of a stream's frames by the same amount
changes nothing about what the prompt asks for: it is the same video seen by a camera that has
moved. The networks do not know that. The transformer's rotary positions say how far apart two
tokens are on a plane, not on a torus, so a shape that wraps across the border reaches it as two
far-apart halves; and the autoencoder's zero-padded convolutions draw the border worse than the
middle. On held-out streams, shapes near the border were misdrawn far more often than the rest
(docs/benchmarks.md, shapes-stream, session 9).

So the serving family (`family.ShapesStreamFamily`) draws every chunk in a frame of its own
(`FollowStream`). A stream keeps its history as pixels, where the world has them. Before each
chunk (`enter_frames`) the history and the prefix are rolled so that the shape of the latest
frame sits in the middle, and packed into latents (the autoencoder encodes them) as the
transformer learnt to read history in training. The chunk is drawn in that frame, decoded once
(`keep_chunks`), and rolled back to the world: those pixels are both the chunk's output and
the next chunk's history. Rolls of pixels on a torus are exact. Rolling latents instead would
not be: a zero-padded autoencoder's latents differ at the frame's edges, so rolled latents
carry a seam into the frame that the decoder draws and the transformer misreads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from genserve.demo_models import scorer, stream_world
from genserve.multimodal_gen.pipelines.helios import HeliosStream


def roll_rows(x: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Row i of `x` [B, ..., H, W] rolled by `shifts[i]` = (down, right) along its last two
    axes (`shifts` [B, 2] integers)."""
    if not bool(shifts.any()):
        return x
    rows = [
        torch.roll(x[i : i + 1], (int(dy), int(dx)), dims=(-2, -1))
        for i, (dy, dx) in enumerate(shifts.tolist())
    ]
    return torch.cat(rows)


def centring_shifts(pixels: torch.Tensor) -> torch.Tensor:
    """[N, 2] (down, right) whole-pixel shifts that bring the shape of each frame of `pixels`
    [N, 3, H, W] (in [-1, 1]) nearest the middle of the frame; zero for a frame with no shape.
    The background is each frame's median colour; the shape's centre is the circular mean of
    the pixels far from it, so a shape across the border reads whole."""
    img = ((pixels.detach().float().clamp(-1, 1) + 1) * 127.5).permute(0, 2, 3, 1).cpu().numpy()
    n, h, w, _ = img.shape
    out = np.zeros((n, 2), np.int64)
    for i, frame in enumerate(img):
        background = np.median(frame.reshape(-1, 3), axis=0)
        mask = np.linalg.norm(frame - background, axis=-1) > scorer.FG_DISTANCE
        centre = stream_world.circular_centroid(mask.astype(np.float32))
        if centre is not None:
            out[i] = (round(h / 2 - centre[1]), round(w / 2 - centre[0]))
    # A roll by a whole turn is no roll: keep each shift within half a turn.
    for axis, cells in ((0, h), (1, w)):
        out[:, axis] = (out[:, axis] + cells // 2) % cells - cells // 2
    return torch.from_numpy(out)


@dataclass
class FollowStream(HeliosStream):
    """A shapes-stream stream. `history` and `prefix` (latents) are in the frame of the
    chunk being drawn: the world rolled by `offset` (down, right) pixels of the drawn frame.
    `pixels` / `prefix_pixels` are the same frames where the world has them, zeros before
    the video starts; `drawn` is the last chunk there, until the chunk loop hands it out."""

    pixels: torch.Tensor | None = None  # [1, 3, F, H, W] in [-1, 1]
    prefix_pixels: torch.Tensor | None = None  # [1, 3, 1, H, W]
    offset: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 2, dtype=torch.long))
    drawn: torch.Tensor | None = None  # [1, 3, chunk, H, W]

    def nbytes(self) -> int:
        tensors = (self.pixels, self.prefix_pixels, self.drawn)
        return super().nbytes() + sum(
            t.numel() * t.element_size() for t in tensors if t is not None
        )


@torch.inference_mode()
def enter_frames(pipe, streams: list[FollowStream]) -> None:
    """Move each stream that has begun into the frame of its next chunk: its shape (in the
    latest frame) in the middle; its history and prefix latents packed from the rolled
    pixels, all streams' in one `pipe.pack` call. A stream not yet begun keeps its empty
    history and no offset (the first chunk opens in the middle)."""
    begun = [s for s in streams if s.prefix_pixels is not None]
    if not begun:
        return
    latest = torch.cat([s.pixels[:, :, -1] for s in begun])
    shifts = centring_shifts(latest)
    frames = torch.cat([torch.cat([s.prefix_pixels, s.pixels], dim=2) for s in begun])
    latents = pipe.pack(roll_rows(frames, shifts).to(begun[0].history.dtype))
    for i, s in enumerate(begun):
        s.offset = shifts[i : i + 1]
        s.prefix, s.history = latents[i : i + 1].split([1, s.history.shape[2]], dim=2)


@torch.inference_mode()
def keep_chunks(pipe, streams: list[FollowStream], latents: torch.Tensor) -> None:
    """The chunk each stream just drew (`latents` [B, C, chunk, h, w], in its frame), decoded
    once and rolled back to the world: it joins the stream's pixel history (its first frame
    becomes the prefix of a stream that just began) and waits in `drawn` for the output.
    Under inference mode: the chunk loop calls it outside, and a decoder graph kept in the
    history would chain every chunk to the one before (memory grows without bound)."""
    world = roll_rows(
        pipe.unpack(latents.float()).clamp(-1, 1), -torch.cat([s.offset for s in streams])
    )
    for i, s in enumerate(streams):
        made = world[i : i + 1]
        if s.prefix_pixels is None:
            s.prefix_pixels = made[:, :, :1].clone()
        n = s.pixels.shape[2]
        s.pixels = torch.cat([s.pixels, made], dim=2)[:, :, -n:].clone()
        s.drawn = made
