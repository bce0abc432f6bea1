"""Decoder embedders (Qwen3-Embedding style): a registry decoder of the Llama family run as a
sentence embedder with last-token pooling.

The model is the family's own decoder without its LM head: `forward` returns the final normed
hidden state of each request's last new token (float32 [batch, hidden]) where the generative
family returns logits. Everything else (paged KV, prefix cache, chunked prefill, continuous
batching) is the runtime's, so embedding requests are prefill-only requests of the scheduler.
A checkpoint that carries an LM head (a `*ForCausalLM` served with `--is-embedding`) has it
skipped while loading.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from genserve.srt.forward_batch import ForwardBatch
from genserve.srt.models.llama import LlamaForCausalLM


class LastTokenEmbedding:
    """Mixin over a `LlamaForCausalLM` family: no LM head, pooled hidden states out."""

    pooled = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        del self.lm_head  # type: ignore[attr-defined]

    def tie_weights(self) -> None:
        """Nothing to tie: the embedder has no LM head."""

    def map_weight_name(self, hf_name: str) -> tuple[str, Any] | None:
        if hf_name.startswith("lm_head.") or ".lm_head." in hf_name:
            return None
        return super().map_weight_name(hf_name)  # type: ignore[misc]

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Float32 [batch, hidden]: the last new token's final hidden state per request."""
        return self.final_hidden(fb).float()  # type: ignore[attr-defined]


@functools.cache
def embedding_variant(base: type) -> type:
    """The embedder class of a registry decoder class (one class per family, made once)."""
    if not issubclass(base, LlamaForCausalLM) or base.forward is not LlamaForCausalLM.forward:
        raise ValueError(
            f"{base.__name__} cannot run as an embedder; decoder embedders are served for the "
            "Llama, Mistral, Qwen2 and Qwen3 families")
    name = base.__name__.replace("ForCausalLM", "") + "ForEmbedding"
    return type(name, (LastTokenEmbedding, base), {"__module__": __name__})
