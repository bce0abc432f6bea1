"""Qwen2-VL and Qwen2.5-VL: the Hugging Face vision tower (run once per distinct image by the
scheduler's image cache) in front of a Qwen2 decoder that runs in genserve's runtime (paged KV,
radix cache) with multimodal rotary positions (M-RoPE): every token has a (t, h, w) position
and the rotary frequencies are split into three sections, one per axis."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from genserve.srt.forward_batch import ForwardBatch
from genserve.srt.layers.rotary_embedding import _base_inv_freq, _rotate
from genserve.srt.model_config import ModelConfig
from genserve.srt.models.llama import LlamaForCausalLM


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


class ImageSplicingLM(LlamaForCausalLM):
    """A Llama-family decoder whose prefill embeddings take the image embeddings at the image
    placeholders (`fb.image_embeds`), and whose rotary reads `fb.mrope_positions` when set."""

    supports_tp = False

    def set_rotary(self, rotary: nn.Module) -> None:
        for layer in self.layers:
            layer.self_attn.rotary = rotary

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:  # type: ignore[override]
        hidden = self.embed_tokens(fb.input_ids)  # [tokens, hidden]
        for start, emb in fb.image_embeds or ():
            hidden[start : start + emb.shape[0]] = emb.to(hidden.dtype)
        positions = fb.mrope_positions if fb.mrope_positions is not None else fb.positions
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, fb)
        hidden = hidden.index_select(0, fb.logits_indices)
        residual = residual.index_select(0, fb.logits_indices)  # type: ignore[union-attr]
        hidden, _ = self.norm(hidden, residual)
        return self.lm_head(hidden).float()


class Qwen2VLLanguageModel(ImageSplicingLM):
    """The Qwen2 decoder of a Qwen2-VL checkpoint, with M-RoPE."""

    def __init__(self, cfg: ModelConfig, mrope_section: list[int]) -> None:
        super().__init__(cfg)
        self.mrope_section = mrope_section
        self.set_rotary(MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, mrope_section))


def rebuild_hf_buffers(module: nn.Module, device: torch.device) -> None:
    """Recompute the non-persistent buffers of Hugging Face modules built on the meta device
    (rotary inverse frequencies, position-id ranges), which `to_empty` left uninitialized."""
    for sub in module.modules():
        names = getattr(sub, "_non_persistent_buffers_set", set())
        if "inv_freq" in names:
            with torch.device(device):
                fresh = type(sub)(sub.config)
            for name in names:
                setattr(sub, name, getattr(fresh, name))
        if "position_ids" in names:
            n = sub.position_ids.shape[-1]
            sub.position_ids = torch.arange(n, device=device).expand((1, -1))


class VisionLanguageModel(nn.Module):
    """What the model runner needs from a vision-language model: a registry decoder
    (`language_model`) that takes the image embeddings, and one Hugging Face vision tower."""

    language_model: ImageSplicingLM

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers

    def tie_weights(self) -> None:
        self.language_model.tie_weights()

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.language_model(fb)

    @staticmethod
    def load_tower(tower: nn.Module, weights: dict[str, torch.Tensor]) -> None:
        """Load a vision tower's weights; a missing or unexpected one is a start-up error
        (non-persistent position-id buffers aside)."""
        missing, unexpected = tower.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise ValueError(
                f"vision tower weights do not match the config: missing {missing[:4]}, "
                f"unexpected {unexpected[:4]}"
            )

    def pixels(self, items: list[Any], tower: nn.Module) -> torch.Tensor:
        """The items' pixel arrays, concatenated, on the decoder's device in the tower's dtype."""
        device = self.language_model.embed_tokens.weight.device
        dtype = next(tower.parameters()).dtype
        return torch.cat([torch.from_numpy(it.pixel_values) for it in items]).to(device, dtype)


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    uses_mrope = True

    def __init__(self, cfg: ModelConfig) -> None:
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
        self.language_model = Qwen2VLLanguageModel(cfg, section)
        self.visual = tower._from_config(hf_cfg.vision_config)
        self.spatial_merge_size = hf_cfg.vision_config.spatial_merge_size

    # ---- model runner hooks -----------------------------------------------------------------

    def rebuild_buffers(self, device: torch.device) -> None:
        lm = self.language_model
        with torch.device(device):
            lm.set_rotary(
                MRotaryEmbedding(self.config.head_dim, self.config.rope_theta, lm.mrope_section)
            )
        rebuild_hf_buffers(self.visual, device)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
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


VLM_ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
}
