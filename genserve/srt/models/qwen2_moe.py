"""Qwen2-MoE: the sparse-MoE decoder with q/k/v biases and a sigmoid-gated shared expert."""

from __future__ import annotations

from genserve.srt.models.mixtral import MixtralForCausalLM


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    qkv_bias = True
    renormalize = None  # norm_topk_prob from the config
