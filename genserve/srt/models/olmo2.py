"""OLMo 2: norms after each sub-block instead of before it (the residual stream is never
normalised on the way in), and RMSNorms over the whole q and k projections (not per head)."""

from __future__ import annotations

import torch
from torch import nn

from genserve.srt.forward_batch import ForwardBatch
from genserve.srt.layers.layernorm import RMSNorm
from genserve.srt.layers.rotary_embedding import RotaryEmbedding
from genserve.srt.model_config import ModelConfig
from genserve.srt.models.base import ModelKernels
from genserve.srt.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Olmo2Attention(LlamaAttention):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, kernels: ModelKernels
    ) -> None:
        super().__init__(cfg, layer_id, rotary, kernels=kernels, qk_norm=False)
        eps = cfg.rms_norm_eps
        self.q_norm = RMSNorm(self.q_size, eps, kernels.norm, weight_before_cast=True)
        self.k_norm = RMSNorm(self.kv_size, eps, kernels.norm, weight_before_cast=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q).reshape(n, self.num_heads, self.head_dim)  # type: ignore[misc]
        k = self.k_norm(k).reshape(n, self.num_kv_heads, self.head_dim)  # type: ignore[misc]
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        o = fb.attn_backend.forward(q, k, v, self.info, fb)
        return self.o_proj(o.reshape(n, self.q_size))


class Olmo2DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, kernels: ModelKernels
    ) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, layer_id, rotary, kernels)
        self.mlp = LlamaMLP(cfg)
        eps = cfg.rms_norm_eps
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, eps, kernels.norm, weight_before_cast=True
        )
        self.post_feedforward_layernorm = RMSNorm(
            cfg.hidden_size, eps, kernels.norm, weight_before_cast=True
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        fb: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # (hidden, residual) as in Llama: the stream is hidden + residual.
        if residual is not None:
            hidden = hidden + residual
        residual = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden, fb))
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class Olmo2ForCausalLM(LlamaForCausalLM):
    supports_tp = False  # its q/k RMSNorm spans every head, not one rank's share

    def make_layer(self, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        return Olmo2DecoderLayer(self.config, layer_id, rotary, self.kernels)

    def __init__(self, cfg: ModelConfig, kernels: ModelKernels = ModelKernels()) -> None:
        super().__init__(cfg, kernels)
        self.norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, kernels.norm, weight_before_cast=True
        )
