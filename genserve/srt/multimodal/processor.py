"""Turns (prompt token ids, image files) into what the scheduler needs, with the checkpoint's
own Hugging Face image processor: pixel arrays, expanded image placeholders, content hashes
and, for families that need them (M-RoPE), the prompt's rotary positions. What differs between
families lives in their `processors/` file, named by the model registry.

Runs in the tokenizer manager (a worker thread of the gateway process), never on the event
loop; it imports transformers only when a vision model is loaded, and sends numpy arrays.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from genserve.srt.messages import ImageItem, MultimodalInputs
from genserve.srt.models.registry import get_processor_class
from genserve.srt.multimodal.image_source import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageInputError,
    open_image,
)
from genserve.srt.multimodal.processors.base import Grid, VisionProcessor


class VisionInputProcessor:
    """Preprocesses a vision-language model's images with its Hugging Face image processor."""

    def __init__(
        self,
        rules: VisionProcessor,
        image_processor: Any,
        max_images: int,
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> None:
        self.rules = rules
        self.image_processor = image_processor
        self.max_images = max_images
        self.max_pixels = max_pixels

    @classmethod
    def from_folder(cls, folder: str | Path, max_images: int) -> VisionInputProcessor | None:
        """None for a text-only model folder."""
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        rules_cls = get_processor_class(config)
        if rules_cls is None:
            return None
        rules = rules_cls.from_config(config)
        from transformers import AutoImageProcessor

        try:
            image_processor = AutoImageProcessor.from_pretrained(str(folder))
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"{folder} is a vision model but has no image processor: {exc}"
            ) from exc
        return cls(rules, image_processor, max_images)

    def process(
        self, input_ids: list[int], images: list[bytes]
    ) -> tuple[list[int], MultimodalInputs]:
        """Expanded token ids and the request's images. ValueError names any bad input."""
        if len(images) > self.max_images:
            raise ImageInputError(
                f"{len(images)} images were given; this model takes at most {self.max_images} "
                "per request"
            )
        runs = _placeholder_runs(input_ids, self.rules.image_token_id)
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
            count = self.rules.num_tokens(grid)
            if length not in (1, count):
                raise ImageInputError(
                    f"image {k} has {length} placeholder tokens; give 1 (or {count})"
                )
            ids.extend(input_ids[prev:start])
            items.append(ImageItem(_content_hash(pixels, grid), pixels, grid, len(ids), count))
            ids.extend([self.rules.image_token_id] * count)
            prev = start + length
        ids.extend(input_ids[prev:])
        mm = MultimodalInputs(items)
        positions = self.rules.positions(len(ids), items)
        if positions is not None:
            mm.mrope_positions, mm.mrope_delta = positions
        return ids, mm

    def check_text_only(self, input_ids: list[int]) -> None:
        """A prompt sent without images must not contain image placeholders."""
        runs = _placeholder_runs(input_ids, self.rules.image_token_id)
        if runs:
            raise ImageInputError(
                f"the prompt has {len(runs)} image placeholders but no images were given"
            )

    def _preprocess(self, data: bytes) -> tuple[np.ndarray, Grid | None]:
        image = open_image(data, self.max_pixels)
        out = self.image_processor(images=[image], return_tensors="np")
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        return pixels, self.rules.grid(out)


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


def _content_hash(pixels: np.ndarray, grid: Grid | None) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((pixels.shape, grid)).encode())
    h.update(pixels.tobytes())
    return h.hexdigest()

