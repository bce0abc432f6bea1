"""Gemma 3: every image becomes `mm_tokens_per_image` soft tokens (the SigLIP tower's patches
average-pooled to that many), whatever its size; the image processor resizes it to the tower's
square input. Pan-and-scan crops (one image as several) are not supported."""

from __future__ import annotations

from typing import Any

from genserve.srt.multimodal.processors.base import Grid, VisionProcessor


class Gemma3Processor(VisionProcessor):
    def __init__(self, image_token_id: int, tokens_per_image: int) -> None:
        super().__init__(image_token_id)
        self.tokens_per_image = tokens_per_image

    @classmethod
    def from_config(cls, config: dict[str, Any], preprocessor: dict[str, Any]) -> Gemma3Processor:
        token = config.get("image_token_index", config.get("image_token_id"))
        if token is None:
            raise ValueError("config.json of a Gemma 3 model needs image_token_index")
        if preprocessor.get("do_pan_and_scan"):
            raise ValueError("Gemma 3's pan-and-scan image crops are not supported")
        return cls(int(token), int(config.get("mm_tokens_per_image", 256)))

    def num_tokens(self, grid: Grid | None) -> int:
        return self.tokens_per_image
