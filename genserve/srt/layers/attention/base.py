"""Attention backends: the only code that reads and writes the paged KV pool."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from genserve.srt.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionLayerInfo:
    layer_id: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    scaling: float  # softmax scale, usually head_dim ** -0.5
    # A token at position p sees keys at positions (p - sliding_window, p]; None = all of them.
    sliding_window: int | None = None
    # Gemma 2: scores become cap * tanh(scores / cap) before the softmax.
    logit_softcap: float | None = None
    # GPT-OSS: one learned logit per query head joins each softmax as an extra column that
    # takes probability mass and adds no value; the layer passes the tensor to `forward`.
    sinks: bool = False
    # Width of the value rows when it differs from the keys' (multi-head latent attention
    # attends over a latent: keys [latent | rope], values the latent); None = head_dim.
    v_head_dim: int | None = None

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim


class AttentionBackend(ABC):
    """Computes paged attention for one model; one instance per model runner."""

    # Whether `init_graph_decode_metadata` exists: a decode plan built from device tensors
    # alone, which a CUDA graph can capture (genserve/srt/decode_graphs.py).
    graph_capturable = False

    def init_graph_decode_metadata(self, forward_batch: ForwardBatch) -> None:
        """The decode plan of `forward_batch` from its device tensors alone (no host values,
        no host sync), in tensors whose shapes depend on the batch size only; it must attend
        exactly as `init_forward_metadata` does. Only where `graph_capturable`."""
        raise NotImplementedError(f"{type(self).__name__} has no graph-capturable decode plan")

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build per-batch metadata (index arrays, split plans) once, before the first layer."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, value_dim]
        layer: AttentionLayerInfo,
        forward_batch: ForwardBatch,
        sinks: torch.Tensor | None = None,  # [num_heads] float, for a layer with `sinks`
    ) -> torch.Tensor:
        """Store k/v at `forward_batch.out_cache_loc` in layer `layer.layer_id` of the pool,
        then attend: each new token sees its request's cached prefix and, causally, the
        new tokens before it. Returns [num_tokens, num_heads, value_dim] in q's dtype."""
