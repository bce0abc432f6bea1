"""Gemma 3 with its vision tower: Hugging Face's SigLIP tower and Gemma 3 projector (patches
average-pooled to `mm_tokens_per_image`, RMS-normed, projected; run once per distinct image by
the scheduler's image cache) in front of genserve's Gemma 3 decoder.

Two things differ from the other vision-language families, as in HF's `Gemma3Model`:
- the image features replace the *scaled* token embeddings (the sqrt(hidden) scale is not
  applied to them);
- in a prefill, the tokens of one image attend to each other both ways (`bidirectional_images`:
  the runtime passes each image's block, the attention backend ORs it into the causal mask, and
  the scheduler never splits an image across prefill chunks). Decoding is causal.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from genserve.srt.forward_batch import ForwardBatch
from genserve.srt.model_config import ModelConfig
from genserve.srt.models.base import ModelKernels
from genserve.srt.models.gemma3 import Gemma3ForCausalLM
from genserve.srt.models.llava import LlavaForConditionalGeneration
from genserve.srt.models.vlm_base import VisionLanguageModel

_DEFAULT_KERNELS = ModelKernels()


class Gemma3VisionLanguageModel(Gemma3ForCausalLM):
    """Gemma 3's decoder taking the image embeddings at the image placeholders."""

    supports_tp = False

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(fb.input_ids)
        hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        for start, emb in fb.image_embeds or ():
            hidden[start : start + emb.shape[0]] = emb.to(hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(fb.positions, hidden, residual, fb)
        hidden = hidden.index_select(0, fb.logits_indices)
        residual = residual.index_select(0, fb.logits_indices)  # type: ignore[union-attr]
        hidden, _ = self.norm(hidden, residual)
        logits = self.lm_head(hidden).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    bidirectional_images: ClassVar[bool] = True

    def __init__(self, cfg: ModelConfig, kernels: ModelKernels = _DEFAULT_KERNELS) -> None:
        super().__init__()
        import transformers
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        hf_cfg = transformers.Gemma3Config.from_dict(dict(cfg.multimodal or {}))
        self.config = cfg
        self.language_model = Gemma3VisionLanguageModel(cfg, kernels)  # type: ignore[assignment]
        self.vision_tower = transformers.AutoModel.from_config(hf_cfg.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_cfg)

    # ---- model runner hooks -----------------------------------------------------------------

    # The decoder's rotary tables, then the tower's buffers, as LLaVA's (same part names).
    rebuild_family_buffers = LlavaForConditionalGeneration.rebuild_family_buffers

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:  # type: ignore[override]
        """Checkpoints name the parts `model.vision_tower.*`, `model.multi_modal_projector.*`,
        `model.language_model.*` and `lm_head.*` (older ones without the `model.` prefix and
        with `language_model.model.*`)."""
        parts: dict[str, dict[str, torch.Tensor]] = {"vision": {}, "proj": {}, "text": {}}
        for name, tensor in weights.items():
            name = name.removeprefix("model.")
            if name.startswith("vision_tower."):
                parts["vision"][name.removeprefix("vision_tower.")] = tensor
            elif name.startswith("multi_modal_projector."):
                parts["proj"][name.removeprefix("multi_modal_projector.")] = tensor
            else:
                name = name.removeprefix("language_model.").removeprefix("model.")
                parts["text"][name if name.startswith("lm_head.") else "model." + name] = tensor
        self.language_model.load_weights(parts["text"].items())
        self.multi_modal_projector.load_state_dict(parts["proj"])
        self.load_tower(self.vision_tower, parts["vision"])

    @torch.inference_mode()
    def encode_images(self, items: list[Any]) -> list[torch.Tensor]:
        """Projected, pooled patch features of each image: [mm_tokens_per_image, hidden]."""
        pixels = self.pixels(items, self.vision_tower)
        out = self.vision_tower(pixel_values=pixels, return_dict=True)
        return list(self.multi_modal_projector(out.last_hidden_state))
