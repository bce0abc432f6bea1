"""Qwen3-MoE: the sparse-MoE decoder with Qwen3's per-head q/k norms."""

from __future__ import annotations

from genserve.srt.models.mixtral import MixtralForCausalLM


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    qk_norm = True
    renormalize = None  # norm_topk_prob from the config
