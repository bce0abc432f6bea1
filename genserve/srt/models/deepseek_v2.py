"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention and a grouped mixture of experts.

- attention: MLA (`layers/mla.py`); the KV pool stores one compressed row per token
  (`kv_lora_rank + qk_rope_head_dim` values shared by every head), not per-head keys and
  values. The query has its own low-rank path when `q_lora_rank` is set (V2 and V3; V2-Lite has
  none). YaRN rotary with DeepSeek's mscale on the softmax scale.
- MLP: the first `first_k_dense_replace` layers are dense; the others are a mixture of
  `n_routed_experts` routed experts (top `num_experts_per_tok` per token) plus
  `n_shared_experts` shared ones that every token runs (one MLP of `n_shared_experts *
  moe_intermediate_size` columns). The routed weights are scaled by `routed_scaling_factor`.
  - V2: softmax scores; `topk_method` "greedy" takes the top k of all experts,
    "group_limited_greedy" only those in the `topk_group` groups (of `n_group`) with the best
    single expert. As in HF transformers, V2 never renormalises the k weights.
  - V3: sigmoid scores; the choice adds `e_score_correction_bias` and keeps the `topk_group`
    groups with the best sum of their two best experts; the weights are the unbiased scores
    of the chosen experts, renormalised when `norm_topk_prob`.

Refused at start-up: tensor parallelism (the latent projections are not split across ranks
yet), weight-only quantization (the absorbed attention reads `kv_b_proj`'s weight directly)
and LoRA adapters: the runner says so. The triton backend runs the latent attention as one
shared key row a token (head_dim kv_lora_rank + rope) whose first kv_lora_rank columns are
the values, which its kernels take narrower than the keys. DeepSeek-V3's
multi-token-prediction layers (past `num_hidden_layers` in the checkpoint) are skipped.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from genserve.srt.distributed import TPGroup
from genserve.srt.layers.layernorm import RMSNorm
from genserve.srt.layers.mla import MLAttention, latent_dims
from genserve.srt.layers.moe import FusedMoE
from genserve.srt.layers.parallel import ParallelLMHead, VocabParallelEmbedding
from genserve.srt.layers.rotary_embedding import RotaryEmbedding
from genserve.srt.model_config import ModelConfig
from genserve.srt.models.base import CausalLM, ModelKernels
from genserve.srt.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from genserve.srt.models.mixtral import _EXPERT, _EXPERT_SHARDS

_SINGLE = TPGroup.single()
_LAYER = re.compile(r"^layers\.(\d+)\.")
_REQUIRED = (
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)


class DeepseekRouter(nn.Module):
    """Scores every expert in float32 and picks each token's top k (see the module doc)."""

    def __init__(self, cfg: ModelConfig, sigmoid: bool) -> None:
        super().__init__()
        hf = cfg.hf
        self.num_experts = int(hf["n_routed_experts"])
        self.top_k = int(hf["num_experts_per_tok"])
        self.sigmoid = sigmoid
        self.grouped = sigmoid or hf.get("topk_method") == "group_limited_greedy"
        self.n_group = int(hf.get("n_group") or 1)
        self.topk_group = int(hf.get("topk_group") or self.n_group)
        self.norm_topk_prob = sigmoid and bool(hf.get("norm_topk_prob"))
        self.scale = float(hf.get("routed_scaling_factor") or 1.0)
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, {self.num_experts}]")
        if self.grouped and (
            self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group
        ):
            raise ValueError(
                f"n_group {self.n_group} must divide n_routed_experts "
                f"{self.num_experts} and topk_group {self.topk_group} be in "
                f"[1, n_group]"
            )
        self.weight = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size))
        if sigmoid:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(self.num_experts), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [tokens, hidden]. Returns (weights [tokens, k] float32, ids [tokens, k])."""
        logits = F.linear(x.float(), self.weight.float())  # [tokens, experts]
        if self.sigmoid:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
        else:
            scores = choice = logits.softmax(dim=-1)
        if self.grouped:
            per_group = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            if self.sigmoid:
                group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = per_group.max(dim=-1).values
            groups = torch.topk(group_scores, self.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
            keep = keep.repeat_interleave(self.num_experts // self.n_group, dim=1)
            choice = choice.masked_fill(~keep, float("-inf") if self.sigmoid else 0.0)
        ids = torch.topk(choice, self.top_k, dim=-1).indices
        weights = (scores if self.sigmoid else choice).gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: ModelKernels, sigmoid: bool) -> None:
        super().__init__()
        hf = cfg.hf
        inter = int(hf["moe_intermediate_size"])
        self.gate = DeepseekRouter(cfg, sigmoid)
        self.experts = FusedMoE(
            self.gate.num_experts, self.gate.top_k, cfg.hidden_size, inter, False, kernels.moe
        )
        shared = int(hf.get("n_shared_experts") or 0)
        self.shared_experts = LlamaMLP(cfg, inter * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts.forward_routed(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm residual layer around MLA and a dense or MoE MLP."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        kernels: ModelKernels,
        sigmoid: bool,
        interleaved_rope: bool,
    ) -> None:
        nn.Module.__init__(self)
        self.self_attn = MLAttention(  # type: ignore[assignment]
            cfg, layer_id, rotary, interleaved_rope=interleaved_rope, norm_kernel=kernels.norm
        )
        dense = layer_id < int(cfg.hf.get("first_k_dense_replace") or 0)
        self.mlp = (  # type: ignore[assignment]
            LlamaMLP(cfg) if dense else DeepseekMoE(cfg, kernels, sigmoid)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.norm)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    # V2: softmax routing and interleaved rotary pairs always.
    sigmoid_router: ClassVar[bool] = False
    supports_tp = False
    supports_quantization = False
    rotary_kernels = ("torch",)
    # Only the MLPs' gate/up are fused; q_proj (V2-Lite) stays a projection of its own.
    stacked_params = (
        (".gate_proj.", ".gate_up_proj.", "gate"),
        (".up_proj.", ".gate_up_proj.", "up"),
    )

    def __init__(
        self, cfg: ModelConfig, kernels: ModelKernels = ModelKernels(), tp: TPGroup = _SINGLE
    ) -> None:
        CausalLM.__init__(self)
        missing = [k for k in _REQUIRED if cfg.hf.get(k) is None]
        if missing:
            raise ValueError(f"config.json of a DeepSeek-V2/V3 model needs {', '.join(missing)}")
        if tp.size > 1:
            raise ValueError(f"--tp is not supported for {cfg.architecture} yet")
        self.config, self.kernels, self.tp = cfg, kernels, tp
        _, rope_dim = latent_dims(cfg)
        rotary = RotaryEmbedding(
            rope_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
            kernel=kernels.rotary,
        )
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(
                cfg, i, rotary, kernels, self.sigmoid_router, self.interleaved_rope()
            )
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.norm)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.tie_weights()

    def interleaved_rope(self) -> bool:
        return True

    def latent_kv_dims(self) -> tuple[int, int] | None:
        return latent_dims(self.config)

    def map_weight_name(self, hf_name: str) -> tuple[str, Any] | None:
        """Per-expert tensors (`experts.N.gate_proj`) and transformers' stacked ones
        (`experts.gate_up_proj` / `experts.down_proj`) go to the stacked w13 / w2; layers past
        `num_hidden_layers` (V3's multi-token prediction) are skipped."""
        name = hf_name.removeprefix("model.")
        layer = _LAYER.match(name)
        if layer is not None and int(layer.group(1)) >= self.config.num_hidden_layers:
            return None
        m = _EXPERT.match(name)
        if m is not None:
            param, part = _EXPERT_SHARDS[m.group(3)]
            expert, experts = int(m.group(2)), int(self.config.hf["n_routed_experts"])
            if expert >= experts:
                raise ValueError(f"weight {hf_name!r} names expert {expert} of {experts}")
            return f"{m.group(1)}.{param}", (expert, part)
        for stacked, param in (
            (".experts.gate_up_proj", ".experts.w13"),
            (".experts.down_proj", ".experts.w2"),
        ):
            if name.endswith(stacked):
                return name.removesuffix(stacked) + param, None
        return super().map_weight_name(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    # V3: sigmoid routing with the score-correction bias; rotary pairs interleaved unless
    # the config says `rope_interleave: false`.
    sigmoid_router = True

    def interleaved_rope(self) -> bool:
        return bool(self.config.hf.get("rope_interleave", True))
