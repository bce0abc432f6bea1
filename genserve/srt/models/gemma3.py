"""Gemma 3 (text): Gemma 2's layer with per-head q/k RMSNorms, no soft-capping by default, and
two rotary tables: local (sliding-window) layers use their own theta (`rope_parameters`
per layer type), global layers the scaled one."""

from __future__ import annotations

from genserve.srt.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
