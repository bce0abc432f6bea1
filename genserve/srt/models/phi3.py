"""Phi-3 / Phi-3.5 (and Phi-4-mini): the Llama decoder whose checkpoints already store q/k/v
as one `qkv_proj` and gate/up as one `gate_up_proj` (loaded whole into the same fused layers),
with longrope scaling and optionally a partial rotary dimension. Under tensor parallelism each
rank takes its rows of q, k and v (of gate and up) from the fused checkpoint tensor."""

from __future__ import annotations

from genserve.srt.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    stacked_params = ()  # the fused names are the checkpoint's own
