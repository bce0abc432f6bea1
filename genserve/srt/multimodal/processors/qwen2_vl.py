"""Qwen2-VL and Qwen2.5-VL: an image becomes one token per merged patch of its grid, and the
prompt gets 3-D rotary positions (M-RoPE)."""

from __future__ import annotations

from typing import Any

import numpy as np

from genserve.srt.messages import ImageItem
from genserve.srt.multimodal.processors.base import Grid, VisionProcessor


class Qwen2VLProcessor(VisionProcessor):
    def __init__(self, image_token_id: int, spatial_merge_size: int) -> None:
        super().__init__(image_token_id)
        self.spatial_merge_size = spatial_merge_size  # merge x merge patches -> one token

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Qwen2VLProcessor:
        token = config.get("image_token_id")
        if token is None:
            raise ValueError("config.json of a Qwen2-VL model needs image_token_id")
        vision = config.get("vision_config") or {}
        return cls(int(token), int(vision.get("spatial_merge_size", 2)))

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
