"""Qwen2-VL and Qwen2.5-VL: the Hugging Face vision tower (run once per distinct image by the
scheduler's image cache) in front of a Qwen2 decoder that runs in genserve's runtime (paged KV,
radix cache) with multimodal rotary positions (M-RoPE): every token has a (t, h, w) position
and the rotary frequencies are split into three sections, one per axis."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from genserve.srt.layers.rotary_embedding import _base_inv_freq, _rotate
from genserve.srt.model_config import ModelConfig
from genserve.srt.models.base import ModelKernels
from genserve.srt.models.vlm_base import (
    ImageSplicingLM,
    VisionLanguageModel,
    rebuild_hf_buffers,
)

_DEFAULT_KERNELS = ModelKernels()


class MRotaryEmbedding(nn.Module):
    """Rotary embedding over [3, T] positions: frequency j takes its angle from axis
    (section of j) % 3, as HF's `Qwen2VLRotaryEmbedding`. Text tokens have three equal rows,
    which gives plain RoPE."""

    def __init__(self, head_dim: int, theta: float, mrope_section: list[int]) -> None:
        super().__init__()
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section {mrope_section} must sum to head_dim / 2 = {head_dim // 2}"
            )
        self.head_dim = head_dim
        self.theta = theta
        self.mrope_section = list(mrope_section)
        self.register_buffer("inv_freq", _base_inv_freq(head_dim, theta), persistent=False)
        axis = np.concatenate([np.full(n, i % 3) for i, n in enumerate(self.mrope_section)])
        self.register_buffer("axis", torch.from_numpy(axis).long(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, T]; q: [T, Hq, D]; k: [T, Hkv, D]."""
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(3, -1)
        freqs = positions.unsqueeze(-1).float() * self.inv_freq  # [3, T, D/2]
        # Frequency j reads axis self.axis[j]: [T, D/2]
        freqs = freqs.gather(0, self.axis.view(1, 1, -1).expand(1, freqs.shape[1], -1))[0]
        cos = freqs.cos().unsqueeze(1)
        sin = freqs.sin().unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


class Qwen2VLLanguageModel(ImageSplicingLM):
    """The Qwen2 decoder of a Qwen2-VL checkpoint, with M-RoPE."""

    def __init__(
        self, cfg: ModelConfig, mrope_section: list[int], kernels: ModelKernels = _DEFAULT_KERNELS
    ) -> None:
        super().__init__(cfg, kernels)
        self.mrope_section = mrope_section
        self.set_rotary(MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, mrope_section))


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    uses_mrope = True
    rotary_kernels = ("torch",)  # M-RoPE has a torch implementation only

    def __init__(self, cfg: ModelConfig, kernels: ModelKernels = _DEFAULT_KERNELS) -> None:
        super().__init__()
        import transformers

        raw = dict(cfg.multimodal or {})
        self.config = cfg
        is_25 = "Qwen2_5_VLForConditionalGeneration" in (raw.get("architectures") or [])
        if is_25:
            from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

            hf_cfg = transformers.Qwen2_5_VLConfig.from_dict(raw)
            tower = hf.Qwen2_5_VisionTransformerPretrainedModel
        else:
            from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

            hf_cfg = transformers.Qwen2VLConfig.from_dict(raw)
            tower = hf.Qwen2VisionTransformerPretrainedModel
        text = hf_cfg.text_config
        rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        section = list(rope.get("mrope_section") or [16, 24, 24])
        self.language_model = Qwen2VLLanguageModel(cfg, section, kernels)
        self.visual = tower._from_config(hf_cfg.vision_config)
        self.spatial_merge_size = hf_cfg.vision_config.spatial_merge_size

    # ---- model runner hooks -----------------------------------------------------------------

    def rebuild_family_buffers(self, device: torch.device) -> None:
        lm = self.language_model
        with torch.device(device):
            lm.set_rotary(
                MRotaryEmbedding(self.config.head_dim, self.config.rope_theta, lm.mrope_section)
            )
        rebuild_hf_buffers(self.visual, device)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:  # type: ignore[override]
        """HF checkpoints name the tower `visual.*` (or `model.visual.*`) and the decoder
        `model.*` (or `model.language_model.*`)."""
        vision: dict[str, torch.Tensor] = {}
        text: dict[str, torch.Tensor] = {}
        for name, tensor in weights.items():
            for prefix in ("model.visual.", "visual."):
                if name.startswith(prefix):
                    vision[name[len(prefix) :]] = tensor
                    break
            else:
                text[name.replace("model.language_model.", "model.", 1)] = tensor
        self.language_model.load_weights(text.items())
        self.load_tower(self.visual, vision)

    @torch.inference_mode()
    def encode_images(self, items: list[Any]) -> list[torch.Tensor]:
        """Merged patch embeddings of each image: [num_tokens, hidden] per item."""
        pixels = self.pixels(items, self.visual)
        grid = torch.tensor(
            [it.grid_thw for it in items], dtype=torch.int64, device=pixels.device
        )
        out = self.visual(pixels, grid_thw=grid)
        merged = out.pooler_output if hasattr(out, "pooler_output") else out
        return list(torch.split(merged, [it.num_tokens for it in items]))

