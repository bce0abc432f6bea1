"""Qwen3-VL: the Hugging Face vision tower (2-D rotary ViT with learned position embeddings
resampled to each image's grid, and a patch merger) in front of a Qwen3 decoder that runs in
genserve's runtime, with two changes from Qwen2-VL:

- interleaved M-RoPE: the rotary frequencies take their axis round-robin (t, h, w, t, h, w, ...)
  over the first 3 * section entries instead of one contiguous block per axis;
- DeepStack: the tower also merges the hidden states of a few of its blocks
  (`deepstack_visual_indexes`), and the k-th of those is added to the decoder's hidden states at
  the image tokens after decoder layer k.

The embedding cache stores one tensor per image: the merged features and the DeepStack features
side by side, [num_tokens, hidden * (1 + num_deepstack)], so a prefill chunk that cuts through an
image slices all of them by the same rows.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from genserve.srt.forward_batch import ForwardBatch
from genserve.srt.model_config import ModelConfig
from genserve.srt.models.base import ModelKernels
from genserve.srt.models.qwen2_vl import MRotaryEmbedding, Qwen2VLForConditionalGeneration
from genserve.srt.models.vlm_base import (
    ImageSplicingLM,
    VisionLanguageModel,
    rebuild_hf_buffers,
)

_DEFAULT_KERNELS = ModelKernels()


class InterleavedMRotaryEmbedding(MRotaryEmbedding):
    """M-RoPE with Qwen3-VL's interleaved layout, as HF's `Qwen3VLTextRotaryEmbedding`:
    frequency j reads axis 1 (h) when j % 3 == 1 and j < 3 * section[1], axis 2 (w) when
    j % 3 == 2 and j < 3 * section[2], and axis 0 (t) otherwise."""

    def __init__(self, head_dim: int, theta: float, mrope_section: list[int]) -> None:
        super().__init__(head_dim, theta, mrope_section)
        j = torch.arange(head_dim // 2, device="cpu")
        axis = torch.zeros_like(j)
        for dim in (1, 2):
            axis[(j % 3 == dim) & (j < 3 * mrope_section[dim])] = dim
        self.axis = axis


def deepstack_forward(lm: ImageSplicingLM, fb: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
    """The decoder's layers over token embeddings `hidden` [tokens, hidden], with each image's
    merged features spliced in and its DeepStack features added after the first layers.
    Returns float32 logits of the rows `fb.logits_indices`."""
    width = hidden.shape[1]
    rows, stacks = [], []
    for start, emb in fb.image_embeds or ():
        n = emb.shape[0]
        hidden[start : start + n] = emb[:, :width].to(hidden.dtype)
        rows.append(torch.arange(start, start + n, device=hidden.device))
        stacks.append(emb[:, width:].to(hidden.dtype))
    index = torch.cat(rows) if rows else None
    # [image tokens, num_deepstack, hidden]
    deep = torch.cat(stacks).view(index.shape[0], -1, width) if index is not None else None
    positions = fb.mrope_positions if fb.mrope_positions is not None else fb.positions
    residual = None
    for i, layer in enumerate(lm.layers):
        hidden, residual = layer(positions, hidden, residual, fb)
        if deep is not None and i < deep.shape[1]:
            # HF adds to the layer's output (residual + MLP output): either half will do.
            residual = residual.index_add(0, index, deep[:, i])
    hidden = hidden.index_select(0, fb.logits_indices)
    residual = residual.index_select(0, fb.logits_indices)  # type: ignore[union-attr]
    hidden, _ = lm.norm(hidden, residual)
    return lm.lm_head(hidden).float()


class Qwen3VLLanguageModel(ImageSplicingLM):
    """The Qwen3 decoder of a Qwen3-VL checkpoint: q/k norms, interleaved M-RoPE, DeepStack."""

    qk_norm = True

    def __init__(
        self, cfg: ModelConfig, mrope_section: list[int], kernels: ModelKernels = _DEFAULT_KERNELS
    ) -> None:
        super().__init__(cfg, kernels)
        self.mrope_section = mrope_section
        self.set_rotary(InterleavedMRotaryEmbedding(cfg.head_dim, cfg.rope_theta, mrope_section))

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:  # type: ignore[override]
        return deepstack_forward(self, fb, self.embed_tokens(fb.input_ids))


class Qwen3VLForConditionalGeneration(VisionLanguageModel):
    uses_mrope = True
    rotary_kernels = ("torch",)  # M-RoPE has a torch implementation only
    # What the MoE variant (`qwen3_vl_moe.py`) changes: the HF config class that reads
    # config.json, and the decoder. The vision tower is the same module in both.
    hf_config_class: ClassVar[str] = "Qwen3VLConfig"
    language_model_class: ClassVar[type[Qwen3VLLanguageModel]] = Qwen3VLLanguageModel

    def __init__(self, cfg: ModelConfig, kernels: ModelKernels = _DEFAULT_KERNELS) -> None:
        super().__init__()
        import transformers
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        self.config = cfg
        hf_config = getattr(transformers, self.hf_config_class)
        hf_cfg = hf_config.from_dict(dict(cfg.multimodal or {}))
        rope = hf_cfg.text_config.rope_parameters or {}
        section = list(rope.get("mrope_section") or [24, 20, 20])
        self.language_model = self.language_model_class(cfg, section, kernels)
        self.visual = Qwen3VLVisionModel._from_config(hf_cfg.vision_config)

    # ---- model runner hooks -----------------------------------------------------------------

    def rebuild_family_buffers(self, device: torch.device) -> None:
        lm = self.language_model
        with torch.device(device):
            lm.set_rotary(
                InterleavedMRotaryEmbedding(
                    self.config.head_dim, self.config.rope_theta, lm.mrope_section
                )
            )
        rebuild_hf_buffers(self.visual, device)

    # Same checkpoint layout as Qwen2-VL: `model.visual.*`, `model.language_model.*`, `lm_head`.
    load_weights = Qwen2VLForConditionalGeneration.load_weights

    @torch.inference_mode()
    def encode_images(self, items: list[Any]) -> list[torch.Tensor]:
        """Per item: [num_tokens, hidden * (1 + num_deepstack)], the merged features and then
        each DeepStack level's, side by side."""
        pixels = self.pixels(items, self.visual)
        grid = torch.tensor([it.grid_thw for it in items], dtype=torch.int64, device=pixels.device)
        out = self.visual(pixels, grid_thw=grid)
        joined = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
        return list(torch.split(joined, [it.num_tokens for it in items]))
