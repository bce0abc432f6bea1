"""What one forward pass of the model runner needs to know about its batch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from genserve.srt.layers.attention.base import AttentionBackend
    from genserve.srt.lora.layers import LoRABatch
    from genserve.srt.mem_cache.memory_pool import KVPool, ReqToTokenPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: every request adds >= 1 new tokens after a cached prefix
    DECODE = "decode"  # every request adds exactly one token


@dataclass
class ForwardBatch:
    """Tensors are on the model's device; the *_cpu lists mirror them for host-side planning.

    Token-major tensors are laid out request after request: request i owns the slice
    [extend_start_loc[i], extend_start_loc[i] + extend_seq_lens[i]) of `input_ids`,
    `positions` and `out_cache_loc`. In DECODE mode every extend length is 1.
    """

    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, position of each token in its sequence
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV pool slot each new token writes
    req_pool_indices: torch.Tensor  # [batch] int64, row of each request in req_to_token
    seq_lens: torch.Tensor  # [batch] int64, prefix + new tokens (length after this forward)
    extend_prefix_lens: torch.Tensor  # [batch] int64, tokens already in the KV pool
    extend_seq_lens: torch.Tensor  # [batch] int64, new tokens in this forward
    extend_start_loc: torch.Tensor  # [batch] int64, exclusive cumsum of extend_seq_lens
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: KVPool
    attn_backend: AttentionBackend
    # Rows of the final hidden states whose logits are needed: the last new token of each
    # request. [batch] int64.
    logits_indices: torch.Tensor = field(default=None)  # type: ignore[assignment]
    # Vision-language models: (first batch row, [rows, hidden] embeddings) to write over the
    # token embeddings of image placeholders, and M-RoPE positions [3, num_tokens] int64.
    image_embeds: list[tuple[int, torch.Tensor]] | None = None
    mrope_positions: torch.Tensor | None = None
    # Per request: [start, end) sequence positions of image blocks whose tokens attend to each
    # other both ways in this prefill (Gemma 3); None when every token attends causally.
    image_blocks: list[list[tuple[int, int]]] | None = None
    # Speculative draft trees (`speculative/tree.py`): per request, None (its new tokens attend
    # causally) or [new, new] bool, new token e seeing new token c where True (the root and
    # e's ancestors); such a request's `positions` are prefix + depth, not prefix + e.
    tree_masks: list[torch.Tensor | None] | None = None
    # Multi-LoRA: which rows use which adapter slot (None: the base model for every row).
    lora: LoRABatch | None = None
    # EAGLE speculation (`speculative/eagle.py`): `capture_hidden` asks a Llama-family target
    # to leave the normed final hidden states of every new token in `hidden_out` [tokens,
    # hidden] (for an EAGLE-3 head: some layers' outputs, [tokens, k * hidden]); an EAGLE head
    # reads the target's features from `hidden_in` [tokens, hidden] and leaves its own output
    # features of the `logits_indices` rows in `hidden_out`.
    capture_hidden: bool = False
    hidden_in: torch.Tensor | None = None
    hidden_out: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
