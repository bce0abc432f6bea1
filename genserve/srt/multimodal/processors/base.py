"""What a vision-language family's processor says about its images, beside the checkpoint's own
Hugging Face image processor (which makes the pixel arrays, in the scheduler process).

Torch-free: it runs in the gateway's tokenizer thread, where it decides from the image's size
alone how many placeholder tokens the image becomes. A family file subclasses `VisionProcessor`
and is named by its entry in `srt/models/registry.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from genserve.srt.messages import ImageItem

Grid = tuple[int, int, int]


class VisionProcessor(ABC):
    """A family's placeholder and position rules, read from its config.json."""

    def __init__(self, image_token_id: int) -> None:
        self.image_token_id = image_token_id

    @classmethod
    @abstractmethod
    def from_config(
        cls, config: dict[str, Any], preprocessor: dict[str, Any]
    ) -> VisionProcessor:
        """The rules of the checkpoint whose config.json is `config` and whose
        preprocessor_config.json is `preprocessor`; ValueError names a missing field."""

    def image_grid(self, width: int, height: int) -> Grid | None:
        """The patch grid (t, h, w) the HF image processor makes of a width x height image, for
        families whose token count depends on the image's size; None for a fixed count."""
        return None

    def grid(self, processed: Any) -> Grid | None:
        """The patch grid of the HF image processor's output (checked against `image_grid`)."""
        return None

    def expand_text(self, text: str, tokenizer: Any) -> str:
        """The prompt text as the checkpoint's own processor hands it to the tokenizer, for
        families whose chat template writes a shorter image marker than the placeholder run
        `process` expects (Gemma 3). Runs before tokenization: only the text gives the
        tokenizer's merges around the marker."""
        return text

    @abstractmethod
    def num_tokens(self, grid: Grid | None) -> int:
        """How many placeholder tokens the image (of patch grid `grid`) becomes."""

    def positions(self, n: int, items: list[ImageItem]) -> tuple[np.ndarray, int] | None:
        """Rotary positions of an expanded prompt of `n` tokens holding `items`, and the shift
        of every position after the prompt; None for plain 1-D positions."""
        return None
