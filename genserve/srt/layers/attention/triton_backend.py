"""Paged attention with the Triton kernels of `genserve.kernels` (the default on CUDA).

Per batch, `init_forward_metadata` flattens the request-to-token rows into kv_indptr/kv_indices
once; every layer then stores its new K/V with the kv_store kernel and runs split-KV decode
attention or extend attention over those indices. A batch with speculative draft trees
(`ForwardBatch.tree_masks`) passes the extend kernel their masks, packed once per batch.

A decode batch's split count depends on its batch size and the pool's context width, not on
its current lengths (the kernel gives each request no more splits than its length needs): the
plan a CUDA graph captures once (`init_graph_decode_metadata`) then attends exactly as the eager
plan does, and the same batch gives the same tokens with graphs on or off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genserve.kernels.decode_attention import choose_num_kv_splits, decode_attention_fwd
from genserve.kernels.extend_attention import extend_attention_fwd
from genserve.kernels.kv_indices import build_kv_indices
from genserve.kernels.kv_store import store_kv
from genserve.srt.forward_batch import ForwardBatch, ForwardMode
from genserve.srt.layers.attention.base import AttentionBackend, AttentionLayerInfo


@dataclass(frozen=True)
class TritonAttnMetadata:
    """Index arrays of one batch, shared by all layers.

    DECODE: kv_indptr/kv_indices cover each request's whole sequence (its new token included,
    already stored by the time attention runs). EXTEND: they cover only the cached prefix;
    the new tokens are rows [qo_indptr[b], qo_indptr[b + 1]) of q/k/v.
    """

    mode: ForwardMode
    kv_indptr: torch.Tensor  # [batch + 1] int64
    kv_indices: torch.Tensor  # [nnz] pool slots
    qo_indptr: torch.Tensor | None  # [batch + 1] int64, EXTEND only
    max_extend_len: int  # EXTEND only (0 in DECODE)
    num_kv_splits: int  # DECODE only (1 in EXTEND)
    # EXTEND with draft trees only: every request's [new, new] mask, row-major and packed
    # (causal for requests without a tree), and each one's start in it, [batch + 1].
    custom_mask: torch.Tensor | None = None
    mask_indptr: torch.Tensor | None = None


class TritonAttnBackend(AttentionBackend):
    graph_capturable = True

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, device: str | torch.device
    ) -> None:
        if min(num_heads, num_kv_heads, head_dim) <= 0:
            raise ValueError(
                f"TritonAttnBackend needs positive sizes, got num_heads={num_heads}, "
                f"num_kv_heads={num_kv_heads}, head_dim={head_dim}"
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.metadata: TritonAttnMetadata | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        req_to_token = fb.req_to_token_pool.req_to_token
        if fb.mode is ForwardMode.DECODE:
            kv_lens, lens_cpu = fb.seq_lens, fb.seq_lens_cpu
        else:
            kv_lens, lens_cpu = fb.extend_prefix_lens, fb.extend_prefix_lens_cpu
        kv_indptr, kv_indices = build_kv_indices(
            req_to_token, fb.req_pool_indices, kv_lens, sum(lens_cpu)
        )
        if fb.mode is ForwardMode.DECODE:
            splits = self._decode_splits(fb)
            self.metadata = TritonAttnMetadata(fb.mode, kv_indptr, kv_indices, None, 0, splits)
            return
        qo_indptr = torch.zeros(fb.batch_size + 1, dtype=torch.int64, device=kv_indptr.device)
        torch.cumsum(fb.extend_seq_lens, 0, out=qo_indptr[1:])
        custom_mask = mask_indptr = None
        if fb.tree_masks is not None:
            custom_mask, mask_indptr = _pack_masks(
                fb.tree_masks, fb.extend_seq_lens_cpu, kv_indptr.device
            )
        max_len = max(fb.extend_seq_lens_cpu, default=0)
        self.metadata = TritonAttnMetadata(
            fb.mode, kv_indptr, kv_indices, qo_indptr, max_len, 1, custom_mask, mask_indptr
        )

    def _decode_splits(self, fb: ForwardBatch) -> int:
        width = fb.req_to_token_pool.req_to_token.shape[1]
        return choose_num_kv_splits(width, fb.batch_size, self.num_kv_heads, self.device)

    def init_graph_decode_metadata(self, forward_batch: ForwardBatch) -> None:
        """kv_indices has room for every row's whole req_to_token row; the kernels read only
        the kv_indptr ranges, computed on the device from seq_lens."""
        fb = forward_batch
        req_to_token = fb.req_to_token_pool.req_to_token
        capacity = fb.batch_size * req_to_token.shape[1]
        kv_indptr, kv_indices = build_kv_indices(
            req_to_token, fb.req_pool_indices, fb.seq_lens, capacity
        )
        self.metadata = TritonAttnMetadata(
            ForwardMode.DECODE, kv_indptr, kv_indices, None, 0, self._decode_splits(fb)
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerInfo,
        forward_batch: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if layer.sinks or sinks is not None:  # the runner refuses these models at start-up
            raise ValueError(f"layer {layer.layer_id}: the triton kernels have no attention sinks")
        meta = self.metadata
        if meta is None or meta.mode is not forward_batch.mode:
            raise RuntimeError("TritonAttnBackend.forward called before init_forward_metadata")
        if (layer.num_heads, layer.num_kv_heads, layer.head_dim) != (
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        ):
            raise ValueError(
                f"layer {layer.layer_id} has heads/kv_heads/head_dim "
                f"{layer.num_heads}/{layer.num_kv_heads}/{layer.head_dim}, the backend was built "
                f"for {self.num_heads}/{self.num_kv_heads}/{self.head_dim}"
            )
        pool = forward_batch.token_to_kv_pool
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        store_kv(k_buf, v_buf, forward_batch.out_cache_loc, k, v)
        # [num_tokens, num_heads, head_dim]
        out = torch.empty(q.shape[:2] + (v.shape[2],), dtype=q.dtype, device=q.device)
        if meta.mode is ForwardMode.DECODE:
            decode_attention_fwd(
                q,
                k_buf,
                v_buf,
                out,
                meta.kv_indptr,
                meta.kv_indices,
                layer.scaling,
                meta.num_kv_splits,
            )
        else:
            assert meta.qo_indptr is not None  # set for every EXTEND batch
            extend_attention_fwd(
                q,
                k,
                v,
                out,
                k_buf,
                v_buf,
                meta.qo_indptr,
                meta.kv_indptr,
                meta.kv_indices,
                meta.max_extend_len,
                layer.scaling,
                meta.custom_mask,
                meta.mask_indptr,
            )
        return out


def _pack_masks(
    masks: list[torch.Tensor | None], lens: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The extend kernel's custom mask: each request's [n, n] mask (causal where None),
    flattened and concatenated, and each one's start."""
    causal = lambda n: torch.ones(n, n, dtype=torch.bool, device=device).tril()
    flat = [(m if m is not None else causal(n)).reshape(-1) for m, n in zip(masks, lens)]
    starts = torch.tensor([0, *(n * n for n in lens)], dtype=torch.int64).cumsum(0)
    return torch.cat(flat).contiguous(), starts.to(device)
