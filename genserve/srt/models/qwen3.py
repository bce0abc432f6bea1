"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before the rotary embedding."""

from __future__ import annotations

from genserve.srt.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
