"""Llama decoder (Llama 2/3.x, SmolLM2): the building blocks most families reuse, reading and
writing the paged KV pool through the attention backend.

Mistral, Qwen2 and Qwen3 are this model with a different default (`mistral.py`, `qwen2.py`,
`qwen3.py`); Gemma, Phi-3, OLMo 2 and the MoE families reuse its attention block.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from genserve.srt.distributed import TPGroup
from genserve.srt.forward_batch import ForwardBatch
from genserve.srt.layers.attention.base import AttentionLayerInfo
from genserve.srt.layers.layernorm import RMSNorm
from genserve.srt.layers.parallel import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_split,
    split_heads,
)
from genserve.srt.layers.rotary_embedding import RotaryEmbedding
from genserve.srt.model_config import ModelConfig
from genserve.srt.models.base import CausalLM, MergedLinear, ModelKernels

_DEFAULT_KERNELS = ModelKernels()
_SINGLE = TPGroup.single()


class LlamaMLP(nn.Module):
    """gate/up column-parallel, down row-parallel: each rank computes its share of the
    intermediate columns (`reduce=False`: returns the rank's partial sum, not all-reduced)."""

    def __init__(
        self,
        cfg: ModelConfig,
        intermediate_size: int | None = None,
        tp: TPGroup = _SINGLE,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        start, per = column_split(inter, tp)
        self.gate_up_proj = MergedLinear(
            cfg.hidden_size,
            {"gate": per, "up": per},
            sources={"gate": (start, per), "up": (start, per)} if tp.size > 1 else None,
            checkpoint_rows={"gate": inter, "up": inter},
        )
        self.down_proj = RowParallelLinear((start, per), cfg.hidden_size, tp, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaAttention(nn.Module):
    """q/k/v projection (optionally biased), optional per-head q/k RMSNorm (Qwen3, Gemma 3),
    rotary embedding, paged attention and the output projection. Under tensor parallelism
    each rank runs its share of the heads (`layers.parallel.q_heads` / `kv_heads`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        *,
        kernels: ModelKernels = _DEFAULT_KERNELS,
        qkv_bias: bool | None = None,
        qk_norm: bool | None = None,
        norm_unit_offset: bool = False,
        scaling: float | None = None,
        logit_softcap: float | None = None,
        tp: TPGroup = _SINGLE,
    ) -> None:
        super().__init__()
        heads = split_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.head_dim = d = cfg.head_dim
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        bias = cfg.attention_bias if qkv_bias is None else qkv_bias
        sources = {
            "q": (heads.q_start * d, self.q_size),
            "k": (heads.kv_start * d, self.kv_size),
            "v": (heads.kv_start * d, self.kv_size),
        }
        self.qkv_proj = MergedLinear(
            cfg.hidden_size,
            {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=bias,
            sources=sources if tp.size > 1 else None,
            checkpoint_rows={
                "q": cfg.num_attention_heads * d,
                "k": cfg.num_key_value_heads * d,
                "v": cfg.num_key_value_heads * d,
            },
        )
        self.o_proj = RowParallelLinear((heads.q_start * d, self.q_size), cfg.hidden_size, tp)
        use_qk_norm = cfg.qk_norm if qk_norm is None else qk_norm
        norm = (
            (lambda: RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels.norm, norm_unit_offset))
            if use_qk_norm
            else None
        )
        self.q_norm = norm() if norm else None
        self.k_norm = norm() if norm else None
        self.rotary = rotary
        self.info = AttentionLayerInfo(
            layer_id=layer_id,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            scaling=self.head_dim**-0.5 if scaling is None else scaling,
            sliding_window=cfg.layer_window(layer_id),
            logit_softcap=logit_softcap,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)  # [tokens, heads, head_dim]
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = fb.attn_backend.forward(q, k, v, self.info, fb)
        return self.o_proj(o.reshape(n, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        *,
        kernels: ModelKernels = _DEFAULT_KERNELS,
        qkv_bias: bool | None = None,
        qk_norm: bool | None = None,
        tp: TPGroup = _SINGLE,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            cfg, layer_id, rotary, kernels=kernels, qkv_bias=qkv_bias, qk_norm=qk_norm, tp=tp
        )
        self.mlp = LlamaMLP(cfg, tp=tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.norm)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        fb: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, fb)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CausalLM):
    # Family defaults the subclasses change (None = what config.json says).
    qkv_bias: ClassVar[bool | None] = None
    qk_norm: ClassVar[bool | None] = None
    supports_tp = True
    # The layers whose outputs (hidden + residual, before any norm), concatenated, a capturing
    # forward leaves in `fb.hidden_out` for an EAGLE-3 head; () leaves the normed last layer's.
    aux_hidden_layers: tuple[int, ...] = ()

    def __init__(
        self, cfg: ModelConfig, kernels: ModelKernels = _DEFAULT_KERNELS, tp: TPGroup = _SINGLE
    ) -> None:
        super().__init__()
        self.config = cfg
        self.kernels = kernels
        self.tp = tp
        rotary = RotaryEmbedding.of_model(cfg, kernels.rotary)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            self.make_layer(i, rotary) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.norm)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.tie_weights()

    def make_layer(self, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        return LlamaDecoderLayer(
            self.config,
            layer_id,
            rotary,
            kernels=self.kernels,
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            tp=self.tp,
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # [tokens, hidden]

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Returns float32 logits [batch, vocab] of the last new token of each request."""
        return self.lm_head(self.final_hidden(fb)).float()

    def final_hidden(self, fb: ForwardBatch) -> torch.Tensor:
        """The normed last-layer hidden states [batch, hidden] of the rows `fb.logits_indices`
        names (what lm_head reads; a decoder embedder's last-token pooling)."""
        hidden = self.embed(fb.input_ids)
        residual = None
        aux = self.aux_hidden_layers if fb.capture_hidden else ()
        outputs = []
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(fb.positions, hidden, residual, fb)
            if i in aux:
                outputs.append(hidden + residual)
        if aux:  # EAGLE-3: the chosen layers' outputs of every token
            fb.hidden_out = torch.cat(outputs, dim=-1)
        elif fb.capture_hidden:  # EAGLE-1/2: every token's normed last-layer output
            fb.hidden_out, _ = self.norm(hidden, residual)
            return fb.hidden_out.index_select(0, fb.logits_indices)
        # Only the rows whose logits are sampled go through the final norm and lm_head.
        hidden = hidden.index_select(0, fb.logits_indices)
        residual = residual.index_select(0, fb.logits_indices)  # type: ignore[union-attr]
        hidden, _ = self.norm(hidden, residual)
        return hidden
