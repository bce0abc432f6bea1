"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a latent KV pool.

Each token's keys and values are compressed into one row shared by all heads: a
`kv_lora_rank` latent c (RMS-normed) and a `qk_rope_head_dim` key k_pe that carries the rotary
position. Per head h, HF transformers expands them with `kv_b_proj` = [W_UK; W_UV]:
k_h = [W_UK_h c | k_pe], v_h = W_UV_h c. Here the up-projections are absorbed instead, so the
pool only ever holds [c | k_pe] (`MLATokenToKVPool`):

    q_h . k_h = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe      (a query in latent space)
    o_h       = W_UV_h (sum_j p_hj c_j)                       (attend over latents, then expand)

so the attention backend sees multi-query attention with one KV head whose key is the whole
row [c | k_pe] and whose value is its first `kv_lora_rank` columns. The math equals HF's
expanded form up to float rounding.

The query comes from `q_proj`, or (`q_lora_rank` set) from its own low-rank path
`q_b_proj(norm(q_a_proj(x)))`. DeepSeek's checkpoints lay each rotary dimension pair out
interleaved (x0, x1), (x2, x3)...; they are de-interleaved before the neox-layout rotary
embedding, the same permutation for q and k, so their dot product is unchanged. With YaRN the
softmax scale gains DeepSeek's mscale(factor, mscale_all_dim)^2 on top of the rotary table's
own attention factor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from genserve.srt.forward_batch import ForwardBatch
from genserve.srt.layers.attention.base import AttentionLayerInfo
from genserve.srt.layers.layernorm import RMSNorm
from genserve.srt.layers.rotary_embedding import RotaryEmbedding
from genserve.srt.model_config import ModelConfig

# HF DeepSeek builds its q_a / kv_a norms with RMSNorm's default eps, not rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under a scaled rope."""
    scale = qk_head_dim**-0.5
    if rope_scaling and rope_scaling.get("rope_type", "default") != "default":
        mscale_all_dim = rope_scaling.get("mscale_all_dim") or 0
        if mscale_all_dim:
            m = yarn_mscale(float(rope_scaling["factor"]), mscale_all_dim)
            scale *= m * m
    return scale


def latent_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(kv_lora_rank, qk_rope_head_dim): the width of one token's latent row."""
    return int(cfg.hf["kv_lora_rank"]), int(cfg.hf["qk_rope_head_dim"])


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...) on the last dim."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        *,
        interleaved_rope: bool,
        norm_kernel: str = "torch",
    ) -> None:
        super().__init__()
        hf = cfg.hf
        hidden = cfg.hidden_size
        self.num_heads = h = cfg.num_attention_heads
        self.kv_lora_rank, self.rope_dim = latent_dims(cfg)
        self.nope_dim = int(hf["qk_nope_head_dim"])
        self.v_dim = int(hf["v_head_dim"])
        qk_dim = self.nope_dim + self.rope_dim
        bias = cfg.attention_bias
        self.q_lora_rank = hf.get("q_lora_rank")
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS, norm_kernel)
            self.q_b_proj = nn.Linear(self.q_lora_rank, h * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, h * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS, norm_kernel)
        # [heads * (nope + v), kv_lora_rank]: per head W_UK rows then W_UV rows.
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, hidden, bias=bias)
        self.rotary = rotary
        self.interleaved_rope = interleaved_rope
        self.info = AttentionLayerInfo(
            layer_id=layer_id,
            num_heads=h,
            num_kv_heads=1,
            head_dim=self.kv_lora_rank + self.rope_dim,
            scaling=mla_softmax_scale(qk_dim, cfg.rope_scaling),
            v_head_dim=self.kv_lora_rank,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        n, h, r = x.shape[0], self.num_heads, self.kv_lora_rank
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(n, h, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([r, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [tokens, kv_lora_rank]
        k_pe = k_pe.reshape(n, 1, self.rope_dim)
        if self.interleaved_rope:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = self.rotary(positions, q_pe.contiguous(), k_pe.contiguous())
        w = self.kv_b_proj.weight.view(h, self.nope_dim + self.v_dim, r)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]  # [h, nope, r], [h, v, r]
        # [h, tokens, nope] @ [h, nope, r] -> the queries in latent space [tokens, h, r].
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        q_full = torch.cat([q_latent, q_pe], dim=-1)  # [tokens, h, r + rope]
        row = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)  # [tokens, 1, r + rope]
        o = fb.attn_backend.forward(q_full, row, row[..., :r], self.info, fb)  # [tokens, h, r]
        # [h, tokens, r] @ [h, r, v] -> [tokens, h, v]
        o = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return self.o_proj(o.reshape(n, h * self.v_dim))
