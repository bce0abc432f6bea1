"""Turns (prompt token ids, image files) into what the scheduler needs, with the checkpoint's
own Hugging Face image processor: pixel arrays, expanded image placeholders, content hashes
and, for M-RoPE models, the 3-D positions of the prompt.

Runs in the tokenizer manager (a worker thread of the gateway process), never on the event
loop; it imports transformers only when a vision model is loaded, and sends numpy arrays.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from genserve.srt.messages import ImageItem, MultimodalInputs
from genserve.srt.multimodal.image_source import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageInputError,
    open_image,
)

# Hugging Face architecture -> the family whose placeholder and position rules apply.
VISION_ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_vl",
    "LlavaForConditionalGeneration": "llava",
}


def vision_family(config: dict[str, Any]) -> str | None:
    for arch in config.get("architectures") or []:
        if arch in VISION_ARCHITECTURES:
            return VISION_ARCHITECTURES[arch]
    return None


@dataclass(frozen=True)
class VisionSpec:
    family: str
    image_token_id: int
    spatial_merge_size: int = 1  # Qwen2-VL merges merge x merge patches into one token
    tokens_per_image: int = 0  # fixed count (LLaVA); 0 = from the image's grid (Qwen2-VL)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionSpec | None:
        family = vision_family(config)
        if family is None:
            return None
        vision = config.get("vision_config") or {}
        if family == "qwen2_vl":
            token = config.get("image_token_id")
            if token is None:
                raise ValueError("config.json of a Qwen2-VL model needs image_token_id")
            return cls(family, int(token), int(vision.get("spatial_merge_size", 2)))
        token = config.get("image_token_index", config.get("image_token_id"))
        if token is None:
            raise ValueError("config.json of a LLaVA model needs image_token_index")
        # Features of every patch, plus CLIP's CLS token, minus one under "default" (which
        # drops the first feature: CLS for CLIP).
        patches = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2
        has_cls = str(vision.get("model_type", "clip_vision_model")).startswith("clip")
        strategy = config.get("vision_feature_select_strategy", "default")
        return cls(family, int(token), 1, patches + has_cls - (strategy == "default"))


class VisionInputProcessor:
    """Preprocesses a vision-language model's images with its Hugging Face image processor."""

    def __init__(
        self,
        spec: VisionSpec,
        image_processor: Any,
        max_images: int,
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> None:
        self.spec = spec
        self.image_processor = image_processor
        self.max_images = max_images
        self.max_pixels = max_pixels

    @classmethod
    def from_folder(cls, folder: str | Path, max_images: int) -> VisionInputProcessor | None:
        """None for a text-only model folder."""
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        spec = VisionSpec.from_config(config)
        if spec is None:
            return None
        from transformers import AutoImageProcessor

        try:
            image_processor = AutoImageProcessor.from_pretrained(str(folder))
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"{folder} is a vision model but has no image processor: {exc}"
            ) from exc
        return cls(spec, image_processor, max_images)

    def process(
        self, input_ids: list[int], images: list[bytes]
    ) -> tuple[list[int], MultimodalInputs]:
        """Expanded token ids and the request's images. ValueError names any bad input."""
        if len(images) > self.max_images:
            raise ImageInputError(
                f"{len(images)} images were given; this model takes at most {self.max_images} "
                "per request"
            )
        runs = _placeholder_runs(input_ids, self.spec.image_token_id)
        if len(runs) != len(images):
            raise ImageInputError(
                f"the prompt has {len(runs)} image placeholders but {len(images)} images were given"
            )
        ids: list[int] = []
        items: list[ImageItem] = []
        prev = 0
        for k, ((start, length), data) in enumerate(zip(runs, images)):
            try:
                pixels, grid = self._preprocess(data)
            except ImageInputError as exc:
                raise ImageInputError(f"image {k}: {exc}") from None
            count = self._num_tokens(grid)
            if length not in (1, count):
                raise ImageInputError(
                    f"image {k} has {length} placeholder tokens; give 1 (or {count})"
                )
            ids.extend(input_ids[prev:start])
            items.append(ImageItem(_content_hash(pixels, grid), pixels, grid, len(ids), count))
            ids.extend([self.spec.image_token_id] * count)
            prev = start + length
        ids.extend(input_ids[prev:])
        mm = MultimodalInputs(items)
        if self.spec.family == "qwen2_vl":
            mm.mrope_positions, mm.mrope_delta = mrope_positions(
                len(ids), items, self.spec.spatial_merge_size
            )
        return ids, mm

    def check_text_only(self, input_ids: list[int]) -> None:
        """A prompt sent without images must not contain image placeholders."""
        runs = _placeholder_runs(input_ids, self.spec.image_token_id)
        if runs:
            raise ImageInputError(
                f"the prompt has {len(runs)} image placeholders but no images were given"
            )

    def _preprocess(self, data: bytes) -> tuple[np.ndarray, tuple[int, int, int] | None]:
        image = open_image(data, self.max_pixels)
        out = self.image_processor(images=[image], return_tensors="np")
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        if self.spec.family == "qwen2_vl":
            t, h, w = (int(x) for x in out["image_grid_thw"][0])
            return pixels, (t, h, w)
        return pixels, None

    def _num_tokens(self, grid: tuple[int, int, int] | None) -> int:
        if grid is None:
            return self.spec.tokens_per_image
        t, h, w = grid
        return t * h * w // self.spec.spatial_merge_size**2


def _placeholder_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token` in ids."""
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def _content_hash(pixels: np.ndarray, grid: tuple[int, int, int] | None) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((pixels.shape, grid)).encode())
    h.update(pixels.tobytes())
    return h.hexdigest()


def mrope_positions(n: int, items: list[ImageItem], merge: int) -> tuple[np.ndarray, int]:
    """Qwen2-VL's 3-D rotary positions ([3, n] int64) and the shift of the positions after them.

    Text tokens advance all three axes together; an image's tokens get (t, row, col) of its
    merged patch grid, offset by the position where the image starts, and the text after it
    resumes at that start + max(rows, cols).
    """
    pos = np.empty((3, n), dtype=np.int64)
    cur, prev = 0, 0
    for item in items:
        assert item.grid_thw is not None
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
