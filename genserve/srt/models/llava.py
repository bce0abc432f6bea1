"""LLaVA: a CLIP or SigLIP vision tower and a projector from Hugging Face (run once per
distinct image by the scheduler's image cache) in front of a Llama / Mistral / Qwen2 decoder
that runs in genserve's runtime. Each image becomes a fixed number of tokens: the tower's patch
features of `vision_feature_layer` (without the CLS token under the "default" strategy)."""

from __future__ import annotations

from typing import Any

import torch

from genserve.srt.model_config import ModelConfig
from genserve.srt.models.base import ModelKernels
from genserve.srt.models.vlm_base import (
    ImageSplicingLM,
    VisionLanguageModel,
    rebuild_hf_buffers,
)

_DEFAULT_KERNELS = ModelKernels()


class LlavaForConditionalGeneration(VisionLanguageModel):
    def __init__(self, cfg: ModelConfig, kernels: ModelKernels = _DEFAULT_KERNELS) -> None:
        super().__init__()
        import transformers
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        raw = dict(cfg.multimodal or {})
        hf_cfg = transformers.LlavaConfig.from_dict(raw)
        self.config = cfg
        self.feature_layer = hf_cfg.vision_feature_layer
        self.select_strategy = hf_cfg.vision_feature_select_strategy
        self.language_model = ImageSplicingLM(cfg, kernels)
        self.vision_tower = transformers.AutoModel.from_config(hf_cfg.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(hf_cfg)

    # ---- model runner hooks -----------------------------------------------------------------

    def rebuild_family_buffers(self, device: torch.device) -> None:
        for module in self.language_model.modules():  # the decoder's rotary tables
            rebuild = getattr(module, "rebuild", None)
            if callable(rebuild):
                rebuild(device)
        rebuild_hf_buffers(self.vision_tower, device)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:  # type: ignore[override]
        """Checkpoints name the parts `vision_tower.*`, `multi_modal_projector.*` and
        `language_model.model.*` / `language_model.lm_head.*` (older) or with a `model.`
        prefix and `lm_head.*` (newer)."""
        parts: dict[str, dict[str, torch.Tensor]] = {"vision": {}, "proj": {}, "text": {}}
        for name, tensor in weights.items():
            name = name.removeprefix("model.")
            if name.startswith("vision_tower."):
                parts["vision"][name.removeprefix("vision_tower.")] = tensor
            elif name.startswith("multi_modal_projector."):
                parts["proj"][name.removeprefix("multi_modal_projector.")] = tensor
            else:
                name = name.removeprefix("language_model.")
                if not name.startswith(("model.", "lm_head.")):
                    name = "model." + name
                parts["text"][name] = tensor
        self.language_model.load_weights(parts["text"].items())
        self.multi_modal_projector.load_state_dict(parts["proj"])
        vision = parts["vision"]
        wants_prefix = any(k.startswith("vision_model.") for k in self.vision_tower.state_dict())
        if wants_prefix and not any(k.startswith("vision_model.") for k in vision):
            vision = {f"vision_model.{k}": v for k, v in vision.items()}
        self.load_tower(self.vision_tower, vision)

    @torch.inference_mode()
    def encode_images(self, items: list[Any]) -> list[torch.Tensor]:
        """Projected patch features of each image: [num_tokens, hidden] per item."""
        pixels = self.pixels(items, self.vision_tower)
        out = self.vision_tower(pixels, output_hidden_states=True, return_dict=True)
        layers = (
            self.feature_layer if isinstance(self.feature_layer, list) else [self.feature_layer]
        )
        feats = [out.hidden_states[i] for i in layers]
        if self.select_strategy == "default":
            feats = [f[:, 1:] for f in feats]
        projected = self.multi_modal_projector(torch.cat(feats, dim=-1))  # [N, tokens, hidden]
        return list(projected)

