"""OLMo 2: norms after each sub-block instead of before it (the residual stream is never
normalised on the way in), and RMSNorms over the whole q and k projections (not per head).

Under tensor parallelism the q and k norms span every rank's heads: each rank sums the squares
of its share, one all-reduce adds them up (q's and k's together), and each rank scales its
share by its slice of the norm weight. A KV head replicated on several ranks (fewer KV heads
than ranks) is counted once.
"""

from __future__ import annotations

import torch
from torch import nn

from genserve.srt.distributed import TPGroup
from genserve.srt.forward_batch import ForwardBatch
from genserve.srt.layers.layernorm import RMSNorm
from genserve.srt.layers.parallel import Slice, split_heads
from genserve.srt.layers.rotary_embedding import RotaryEmbedding
from genserve.srt.model_config import ModelConfig
from genserve.srt.models.base import ModelKernels
from genserve.srt.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

_SINGLE = TPGroup.single()


class SplitNormWeight(nn.Module):
    """The weight of an RMSNorm over features split across ranks: this rank's `length`
    features from `start` of the checkpoint's `full_size`; `replicas` ranks hold each one."""

    def __init__(self, start: int, length: int, full_size: int, replicas: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(length))
        self.start, self.full_size, self.replicas = start, full_size, replicas

    def checkpoint_slice(self, leaf: str, shard: object) -> Slice | None:
        return 0, self.start, self.weight.shape[0]

    def normalize(self, h: torch.Tensor, square_sum: torch.Tensor, eps: float) -> torch.Tensor:
        """h (float32) normalised by the all-reduced sum of squares, scaled by the weight."""
        mean = square_sum / (self.full_size * self.replicas)
        return self.weight * (h * torch.rsqrt(mean + eps))


class Olmo2Attention(LlamaAttention):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        kernels: ModelKernels,
        tp: TPGroup = _SINGLE,
    ) -> None:
        super().__init__(cfg, layer_id, rotary, kernels=kernels, qk_norm=False, tp=tp)
        eps = cfg.rms_norm_eps
        self.tp = tp
        self.eps = eps
        self.q_norm: nn.Module
        self.k_norm: nn.Module
        if tp.size == 1:
            self.q_norm = RMSNorm(self.q_size, eps, kernels.norm, weight_before_cast=True)
            self.k_norm = RMSNorm(self.kv_size, eps, kernels.norm, weight_before_cast=True)
            return
        heads = split_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        d, kv = cfg.head_dim, cfg.num_key_value_heads
        self.q_norm = SplitNormWeight(
            heads.q_start * d, self.q_size, cfg.num_attention_heads * d, 1
        )
        self.k_norm = SplitNormWeight(
            heads.kv_start * d, self.kv_size, kv * d, tp.size // kv if kv < tp.size else 1
        )

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp.size == 1:
            return self.q_norm(q), self.k_norm(k)
        qf, kf = q.float(), k.float()
        sums = torch.cat([qf.pow(2).sum(-1, keepdim=True), kf.pow(2).sum(-1, keepdim=True)], -1)
        sums = self.tp.all_reduce(sums)  # [tokens, 2]: every rank's q and k squares
        assert isinstance(self.q_norm, SplitNormWeight)
        assert isinstance(self.k_norm, SplitNormWeight)
        q = self.q_norm.normalize(qf, sums[:, :1], self.eps).to(q.dtype)
        k = self.k_norm.normalize(kf, sums[:, 1:], self.eps).to(k.dtype)
        return q, k

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.norm_qk(q, k)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        o = fb.attn_backend.forward(q, k, v, self.info, fb)
        return self.o_proj(o.reshape(n, self.q_size))


class Olmo2DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        kernels: ModelKernels,
        tp: TPGroup = _SINGLE,
    ) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, layer_id, rotary, kernels, tp)
        self.mlp = LlamaMLP(cfg, tp=tp)
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
    def make_layer(self, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        return Olmo2DecoderLayer(self.config, layer_id, rotary, self.kernels, self.tp)

    def __init__(
        self, cfg: ModelConfig, kernels: ModelKernels = ModelKernels(), tp: TPGroup = _SINGLE
    ) -> None:
        super().__init__(cfg, kernels, tp)
        self.norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, kernels.norm, weight_before_cast=True
        )
