"""Qwen2-VL and Qwen2.5-VL: an image becomes one token per merged patch of its grid, and the
prompt gets 3-D rotary positions (M-RoPE)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from genserve.srt.messages import ImageItem
from genserve.srt.multimodal.processors.base import Grid, VisionProcessor


class Qwen2VLProcessor(VisionProcessor):
    def __init__(
        self,
        image_token_id: int,
        spatial_merge_size: int,
        patch_size: int = 14,
        min_pixels: int = 56 * 56,
        max_pixels: int = 28 * 28 * 1280,
    ) -> None:
        super().__init__(image_token_id)
        self.spatial_merge_size = spatial_merge_size  # merge x merge patches -> one token
        self.patch_size = patch_size
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels

    @classmethod
    def from_config(cls, config: dict[str, Any], preprocessor: dict[str, Any]) -> Qwen2VLProcessor:
        token = config.get("image_token_id")
        if token is None:
            raise ValueError("config.json of a Qwen2-VL model needs image_token_id")
        vision = config.get("vision_config") or {}
        merge = int(vision.get("spatial_merge_size", 2))
        # Hugging Face's Qwen2VLImageProcessor: `min_pixels` / `max_pixels` override `size`.
        size = preprocessor.get("size") or {}
        return cls(
            int(token),
            merge,
            int(preprocessor.get("patch_size", vision.get("patch_size", 14))),
            int(preprocessor.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            int(preprocessor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
        )

    def image_grid(self, width: int, height: int) -> Grid:
        """One temporal patch of (resized height / patch) x (resized width / patch) patches, the
        size resized as Hugging Face's `smart_resize` does it (multiples of patch * merge, the
        pixel count within [min_pixels, max_pixels], the aspect ratio kept)."""
        h, w = smart_resize(height, width, self.patch_size * self.spatial_merge_size,
                            self.min_pixels, self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def grid(self, processed: Any) -> Grid:
        t, h, w = (int(x) for x in processed["image_grid_thw"][0])
        return t, h, w

    def num_tokens(self, grid: Grid | None) -> int:
        if grid is None:
            raise ValueError("a Qwen2-VL image needs its patch grid")
        t, h, w = grid
        return t * h * w // self.spatial_merge_size**2

    def positions(self, n: int, items: list[ImageItem]) -> tuple[np.ndarray, int]:
        return mrope_positions(n, items, self.spatial_merge_size)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) of the image as Qwen2-VL's image processor resizes it."""
    ratio = max(height, width) / min(height, width)
    if ratio > 200:
        raise ValueError(f"the image's aspect ratio must be below 200, got {ratio:.0f}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def mrope_positions(n: int, items: list[ImageItem], merge: int) -> tuple[np.ndarray, int]:
    """Qwen2-VL's 3-D rotary positions ([3, n] int64) and the shift of the positions after them.

    Text tokens advance all three axes together; an image's tokens get (t, row, col) of its
    merged patch grid, offset by the position where the image starts, and the text after it
    resumes at that start + max(rows, cols).
    """
    pos = np.empty((3, n), dtype=np.int64)
    cur, prev = 0, 0
    for item in items:
        if item.grid_thw is None:
            raise ValueError("M-RoPE positions need every image's patch grid")
        text = item.offset - prev
        pos[:, prev : item.offset] = np.arange(cur, cur + text)
        cur += text
        t, h, w = item.grid_thw
        h, w = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        end = item.offset + item.num_tokens
        pos[0, item.offset : end] = tt.reshape(-1) + cur
        pos[1, item.offset : end] = hh.reshape(-1) + cur
        pos[2, item.offset : end] = ww.reshape(-1) + cur
        cur += max(h, w)
        prev = end
    pos[:, prev:] = np.arange(cur, cur + n - prev)
    delta = int(pos.max()) + 1 - n if n else 0
    return pos, delta
