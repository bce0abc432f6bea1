"""What every vision-language family shares: a registry decoder that splices image embeddings
into its prefill (`ImageSplicingLM`), the model class the runner loads (`VisionLanguageModel`:
decoder + Hugging Face vision tower) and the rebuild of HF buffers after meta-device
construction. A family file (`qwen2_vl.py`, `llava.py`) adds its tower, weight names and
`encode_images`; its image rules live in `srt/multimodal/processors/`."""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from genserve.srt.forward_batch import ForwardBatch
from genserve.srt.models.base import CausalLM
from genserve.srt.models.llama import LlamaForCausalLM


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


class VisionLanguageModel(CausalLM):
    """What the model runner needs from a vision-language model: a registry decoder
    (`language_model`) that takes the image embeddings, and one Hugging Face vision tower.

    The runner loads it like a text model (meta construction, serving dtype, buffers rebuilt,
    checkpoint loaded); what it does not support yet is declared here and refused by the
    runner's common checks: tensor parallelism and weight-only quantization (the HF towers are
    plain `nn.Linear` stacks the parallel and quantized layers do not cover)."""

    supports_tp = False
    supports_quantization = False
    # Whether the decoder takes M-RoPE positions (the scheduler's multimodal runtime asks).
    uses_mrope: ClassVar[bool] = False

    language_model: ImageSplicingLM

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers

    def tie_weights(self) -> None:
        self.language_model.tie_weights()

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.language_model(fb)

    def rebuild_buffers(self, device: torch.device) -> None:
        """The family's buffers (`rebuild_family_buffers`), then every floating buffer in the
        model's dtype: HF towers run their rotary tables in the weights' dtype."""
        self.rebuild_family_buffers(device)
        dtype = self.language_model.embed_tokens.weight.dtype
        for module in self.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf.is_floating_point() and buf.dtype != dtype:
                    setattr(module, name, buf.to(dtype))

    @abstractmethod
    def rebuild_family_buffers(self, device: torch.device) -> None:
        """Recompute the decoder's and the tower's buffers on `device`."""

    @abstractmethod
    def encode_images(self, items: list[Any]) -> list[torch.Tensor]:
        """Each image's embeddings, [num_tokens, hidden], in the order of `items` (their
        `pixel_values` as the family's processor made them)."""

    def load_checkpoint(self, folder: Path) -> None:
        """Vision towers are HF modules, filled from the whole state dict (towers are small next
        to the decoder) by the family's `load_weights`."""
        from genserve.srt.model_loader import load_state_dict

        self.load_weights(load_state_dict(folder))

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
