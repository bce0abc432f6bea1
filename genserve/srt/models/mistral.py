"""Mistral: the Llama decoder with sliding-window attention in every layer (when the config
sets `sliding_window`; the attention backend masks keys older than the window)."""

from __future__ import annotations

from genserve.srt.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
