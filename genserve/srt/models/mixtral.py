"""Mixtral and the Qwen MoE families: the Llama decoder whose MLP is a sparse mixture of
experts (softmax router, top-k experts per token).

- Mixtral: `block_sparse_moe` with experts w1 (gate) / w3 (up) / w2 (down), top-k weights
  always renormalised;
- Qwen2-MoE (`qwen2_moe.py`): q/k/v biases, `norm_topk_prob`, plus a shared expert scaled by
  a sigmoid gate;
- Qwen3-MoE (`qwen3_moe.py`): per-head q/k norms, `norm_topk_prob`.
Layers listed in `mlp_only_layers` (or off the `decoder_sparse_step` grid) keep a dense MLP.

Under tensor parallelism attention splits as in the Llama family; the experts are split across
the ranks (each holds a contiguous slice and loads only those experts' tensors), the router is
replicated, the shared expert is column/row-parallel like a dense MLP, and the block's partial
outputs (its experts', its share of the shared expert's) are summed in one all-reduce.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
from torch import nn

from genserve.srt.distributed import TPGroup
from genserve.srt.layers.moe import FusedMoE
from genserve.srt.layers.parallel import column_split
from genserve.srt.layers.rotary_embedding import RotaryEmbedding
from genserve.srt.model_config import ModelConfig
from genserve.srt.models.base import ModelKernels
from genserve.srt.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

# Per-expert checkpoint names: (module part, expert weight) -> (w13 | w2, shard part).
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_SHARDS = {
    "w1": ("w13", "gate"),
    "gate_proj": ("w13", "gate"),
    "w3": ("w13", "up"),
    "up_proj": ("w13", "up"),
    "w2": ("w2", "down"),
    "down_proj": ("w2", "down"),
}


def num_experts(cfg: ModelConfig) -> int:
    return cfg.hf.get("num_local_experts") or cfg.hf["num_experts"]


class SparseMoeBlock(nn.Module):
    def __init__(
        self, cfg: ModelConfig, kernels: ModelKernels, renormalize: bool, tp: TPGroup
    ) -> None:
        super().__init__()
        hf = cfg.hf
        experts = num_experts(cfg)
        inter = hf.get("moe_intermediate_size") or cfg.intermediate_size
        self.tp = tp
        self.gate = nn.Linear(cfg.hidden_size, experts, bias=False)  # replicated on every rank
        self.experts = FusedMoE(
            experts,
            hf["num_experts_per_tok"],
            cfg.hidden_size,
            inter,
            renormalize,
            kernels.moe,
            experts=column_split(experts, tp),
        )
        shared = hf.get("shared_expert_intermediate_size") or 0
        self.shared_expert = LlamaMLP(cfg, shared, tp=tp, reduce=False) if shared else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # The sigmoid gate is per token, so it scales each rank's partial sum alike.
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)


class MixtralForCausalLM(LlamaForCausalLM):
    # Mixtral always renormalises its top-k weights; the Qwen families read norm_topk_prob.
    renormalize: ClassVar[bool | None] = True

    def make_layer(self, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        layer = super().make_layer(layer_id, rotary)
        hf = self.config.hf
        step = hf.get("decoder_sparse_step") or 1
        dense = layer_id in (hf.get("mlp_only_layers") or []) or (layer_id + 1) % step != 0
        if not dense:
            renorm = self.renormalize
            if renorm is None:
                renorm = bool(hf.get("norm_topk_prob", False))
            assert isinstance(layer, LlamaDecoderLayer)
            layer.mlp = SparseMoeBlock(  # type: ignore[assignment]
                self.config, self.kernels, renorm, self.tp
            )
        return layer

    def map_weight_name(self, hf_name: str) -> tuple[str, Any] | None:
        """Expert tensors map to (w13 | w2, (local expert, part)); None for an expert another
        tensor-parallel rank holds, so that it is never read."""
        name = hf_name.replace(".block_sparse_moe.", ".mlp.")
        m = _EXPERT.match(name.removeprefix("model."))
        if m is not None:
            param, part = _EXPERT_SHARDS[m.group(3)]
            expert, experts = int(m.group(2)), num_experts(self.config)
            if expert >= experts:
                raise ValueError(f"weight {hf_name!r} names expert {expert} of {experts}")
            start, count = column_split(experts, self.tp)
            local = expert - start
            if not 0 <= local < count:
                return None
            return f"{m.group(1)}.{param}", (local, part)
        return super().map_weight_name(name)
