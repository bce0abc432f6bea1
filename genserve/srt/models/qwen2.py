"""Qwen2 / Qwen2.5: the Llama decoder with q/k/v biases (always present in Qwen2 checkpoints)
and sliding-window attention in the layers `layer_types` marks, when `use_sliding_window`."""

from __future__ import annotations

from genserve.srt.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
