"""Turns (prompt token ids, image files) into what the scheduler needs: expanded image
placeholders, the images' files and content hashes and, for families that need them (M-RoPE),
the prompt's rotary positions. What differs between families lives in their `processors/`
file, named by the model registry.

Runs in the tokenizer manager (a worker thread of the gateway process) and stays torch-free: it
reads only each image's size (PIL). The pixel arrays are made in the scheduler process
(`preprocess.py`), and only for images whose embeddings it has not cached.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from genserve.srt.messages import ImageItem, MultimodalInputs
from genserve.srt.models.registry import get_processor_class
from genserve.srt.multimodal.image_source import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageInputError,
    open_image,
)
from genserve.srt.multimodal.processors.base import VisionProcessor


def read_vision_processor(folder: str | Path) -> VisionProcessor | None:
    """The family rules of a model folder (config.json + preprocessor_config.json); None for a
    text-only model."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    rules_cls = get_processor_class(config)
    if rules_cls is None:
        return None
    path = folder / "preprocessor_config.json"
    if not path.is_file():
        raise ValueError(f"{folder} is a vision model but has no preprocessor_config.json")
    return rules_cls.from_config(config, json.loads(path.read_text()))


class VisionInputProcessor:
    """Expands a vision-language model's image placeholders (gateway side, no torch)."""

    def __init__(
        self,
        rules: VisionProcessor,
        max_images: int,
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> None:
        self.rules = rules
        self.max_images = max_images
        self.max_pixels = max_pixels

    @classmethod
    def from_folder(cls, folder: str | Path, max_images: int) -> VisionInputProcessor | None:
        """None for a text-only model folder."""
        rules = read_vision_processor(folder)
        return cls(rules, max_images) if rules is not None else None

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
                grid = self._grid(data)
            except ImageInputError as exc:
                raise ImageInputError(f"image {k}: {exc}") from None
            count = self.rules.num_tokens(grid)
            if length not in (1, count):
                raise ImageInputError(
                    f"image {k} has {length} placeholder tokens; give 1 (or {count})"
                )
            ids.extend(input_ids[prev:start])
            items.append(ImageItem(content_hash(data), data, grid, len(ids), count))
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

    def _grid(self, data: bytes) -> Any:
        """The image's patch grid from its size; decoding it here also refuses, with a 400,
        what the scheduler could not decode."""
        image = open_image(data, self.max_pixels)
        try:
            return self.rules.image_grid(*image.size)
        except ValueError as exc:
            raise ImageInputError(str(exc)) from None


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


def content_hash(data: bytes) -> str:
    """The key of an image file in the scheduler's embedding cache (and its radix tag)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()
