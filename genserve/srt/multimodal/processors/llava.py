"""LLaVA: every image becomes a fixed number of tokens, the vision tower's patch features (plus
CLIP's CLS token, minus the first feature under the "default" select strategy)."""

from __future__ import annotations

from typing import Any

from genserve.srt.multimodal.processors.base import Grid, VisionProcessor


class LlavaProcessor(VisionProcessor):
    def __init__(self, image_token_id: int, tokens_per_image: int) -> None:
        super().__init__(image_token_id)
        self.tokens_per_image = tokens_per_image

    @classmethod
    def from_config(cls, config: dict[str, Any], preprocessor: dict[str, Any]) -> LlavaProcessor:
        token = config.get("image_token_index", config.get("image_token_id"))
        if token is None:
            raise ValueError("config.json of a LLaVA model needs image_token_index")
        vision = config.get("vision_config") or {}
        patches = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2
        has_cls = str(vision.get("model_type", "clip_vision_model")).startswith("clip")
        strategy = config.get("vision_feature_select_strategy", "default")
        return cls(int(token), patches + has_cls - (strategy == "default"))

    def num_tokens(self, grid: Grid | None) -> int:
        return self.tokens_per_image
