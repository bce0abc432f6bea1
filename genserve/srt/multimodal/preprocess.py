"""The scheduler process's image preprocessing: the checkpoint's own Hugging Face image
processor turns an image file into the pixel array its vision tower reads.

It runs only on an embedding-cache miss (the runtime asks for the images it must encode), so a
repeated image is neither decoded nor preprocessed again, and only encoded files cross the pipe
from the gateway. Hugging Face's image processors import torch, which is why this lives in the
scheduler process and not in the gateway's tokenizer manager.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from genserve.srt.messages import ImageItem
from genserve.srt.multimodal.image_source import open_image
from genserve.srt.multimodal.processor import read_vision_processor
from genserve.srt.multimodal.processors.base import VisionProcessor


class ImagePreprocessor:
    def __init__(self, rules: VisionProcessor, image_processor: Any) -> None:
        self.rules = rules
        self.image_processor = image_processor
        self.images_preprocessed = 0

    @classmethod
    def from_folder(cls, folder: str | Path) -> ImagePreprocessor:
        rules = read_vision_processor(folder)
        if rules is None:
            raise ValueError(f"{folder} is not a vision-language model")
        from transformers import AutoImageProcessor

        try:
            image_processor = AutoImageProcessor.from_pretrained(str(folder))
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"{folder} is a vision model but has no image processor: {exc}"
            ) from exc
        return cls(rules, image_processor)

    def with_pixels(self, item: ImageItem) -> ImageItem:
        """The item with its pixel array. The gateway decoded the same file to count its
        tokens, so a decode error or a different patch grid here is a bug, raised as such."""
        image = open_image(item.data)
        out = self.image_processor(images=[image], return_tensors="np")
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        grid = self.rules.grid(out)
        if grid != item.grid_thw:
            raise RuntimeError(
                f"the image processor made a {grid} patch grid where the gateway counted "
                f"{item.grid_thw}"
            )
        self.images_preprocessed += 1
        return dataclasses.replace(item, pixel_values=pixels)
