"""Gemma 2: the Llama attention block with Gemma's choices.

- embeddings scaled by sqrt(hidden_size); RMSNorms scale by (1 + weight);
- four norms per layer: before and after attention, before and after the MLP;
- a GELU (tanh) gated MLP;
- softmax scale query_pre_attn_scalar ** -0.5 and attention logits soft-capped
  (cap * tanh(scores / cap)), sliding-window attention in the layers `layer_types` marks;
- final logits soft-capped too.

Tensor parallel as the Llama family: heads, MLP columns and the vocabulary split across ranks
(the embedding scale and the final soft-cap apply to the reduced / gathered values).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from genserve.srt.distributed import TPGroup
from genserve.srt.forward_batch import ForwardBatch
from genserve.srt.layers.layernorm import RMSNorm
from genserve.srt.layers.parallel import ParallelLMHead, VocabParallelEmbedding
from genserve.srt.layers.rotary_embedding import RotaryEmbedding
from genserve.srt.model_config import ModelConfig
from genserve.srt.models.base import CausalLM, ModelKernels
from genserve.srt.models.llama import LlamaAttention, LlamaMLP

_SINGLE = TPGroup.single()


class GemmaMLP(LlamaMLP):
    """Llama's gated MLP (and its tensor-parallel split) with a tanh-approximated GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma2DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        kernels: ModelKernels,
        qk_norm: bool,
        tp: TPGroup = _SINGLE,
    ) -> None:
        super().__init__()
        hf = cfg.hf
        self.self_attn = LlamaAttention(
            cfg,
            layer_id,
            rotary,
            kernels=kernels,
            qk_norm=qk_norm,
            norm_unit_offset=True,
            scaling=float(hf.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5,
            logit_softcap=hf.get("attn_logit_softcapping"),
            tp=tp,
        )
        self.mlp = GemmaMLP(cfg, tp=tp)

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.norm, unit_offset=True)

        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

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
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, fb))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2ForCausalLM(CausalLM):
    qk_norm: ClassVar[bool] = False
    supports_tp = True

    def __init__(
        self, cfg: ModelConfig, kernels: ModelKernels = ModelKernels(), tp: TPGroup = _SINGLE
    ) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        rotaries: dict[str, RotaryEmbedding] = {}
        layers = []
        for i in range(cfg.num_hidden_layers):
            kind = cfg.layer_types[i] if cfg.layer_types else "full_attention"
            if kind not in rotaries:
                theta, scaling = cfg.rope_for(kind)
                rotaries[kind] = RotaryEmbedding(
                    cfg.head_dim,
                    cfg.max_position_embeddings,
                    theta,
                    scaling,
                    kernel=kernels.rotary,
                    rotary_dim=cfg.rotary_dim,
                )
            layers.append(Gemma2DecoderLayer(cfg, i, rotaries[kind], kernels, self.qk_norm, tp))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.norm, unit_offset=True)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.final_softcap = cfg.hf.get("final_logit_softcapping")
        self.tie_weights()

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(fb.input_ids)
        # HF multiplies by sqrt(hidden) rounded to the activations' dtype.
        hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
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
