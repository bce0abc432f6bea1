"""Gemma 3: every image becomes `mm_tokens_per_image` soft tokens (the SigLIP tower's patches
average-pooled to that many), whatever its size; the image processor resizes it to the tower's
square input. Pan-and-scan crops (one image as several) are not supported.

Gemma 3's chat template writes only the begin-of-image token for an image; its processor
replaces each with "\n\n", that token, the soft tokens and the end-of-image token, then
"\n\n", and tokenizes the result. `expand_text` does the same to a prompt's text. A marker
already followed by a soft token (a prompt written out in full) is left as it is."""

from __future__ import annotations

import re
from typing import Any

from genserve.srt.multimodal.processors.base import Grid, VisionProcessor


class Gemma3Processor(VisionProcessor):
    def __init__(self, image_token_id: int, tokens_per_image: int,
                 boi_token_id: int | None = None, eoi_token_id: int | None = None) -> None:
        super().__init__(image_token_id)
        self.tokens_per_image = tokens_per_image
        self.boi_token_id, self.eoi_token_id = boi_token_id, eoi_token_id
        self._expansion: tuple[re.Pattern, str] | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any], preprocessor: dict[str, Any]) -> Gemma3Processor:
        token = config.get("image_token_index", config.get("image_token_id"))
        if token is None:
            raise ValueError("config.json of a Gemma 3 model needs image_token_index")
        if preprocessor.get("do_pan_and_scan"):
            raise ValueError("Gemma 3's pan-and-scan image crops are not supported")
        boi, eoi = config.get("boi_token_index"), config.get("eoi_token_index")
        return cls(int(token), int(config.get("mm_tokens_per_image", 256)),
                   None if boi is None else int(boi), None if eoi is None else int(eoi))

    def expand_text(self, text: str, tokenizer: Any) -> str:
        if self.boi_token_id is None or self.eoi_token_id is None or tokenizer is None:
            return text
        if self._expansion is None:
            boi, eoi, image = tokenizer.convert_ids_to_tokens(
                [self.boi_token_id, self.eoi_token_id, self.image_token_id])
            marker = re.compile(re.escape(boi) + "(?!" + re.escape(image) + ")")
            self._expansion = marker, f"\n\n{boi}{image * self.tokens_per_image}{eoi}\n\n"
        marker, full = self._expansion
        return marker.sub(lambda _: full, text)

    def num_tokens(self, grid: Grid | None) -> int:
        return self.tokens_per_image
