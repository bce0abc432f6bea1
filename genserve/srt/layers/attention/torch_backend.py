"""Paged attention in plain torch (SDPA over K/V gathered from the pool): the CPU backend and
the reference the Triton backend is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from genserve.srt.forward_batch import ForwardBatch, ForwardMode
from genserve.srt.layers.attention.base import AttentionBackend, AttentionLayerInfo


class TorchAttnBackend(AttentionBackend):
    def __init__(self) -> None:
        self._decode_index: torch.Tensor | None = None  # [batch, max_len] KV slots, 0 = padding
        self._decode_mask: torch.Tensor | None = None  # [batch, 1, 1, max_len] bool
        self._extend_slots: list[torch.Tensor] = []  # per request: [seq_len] KV slots

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        req_to_token = fb.req_to_token_pool.req_to_token
        if fb.mode is ForwardMode.DECODE:
            max_len = max(fb.seq_lens_cpu)
            rows = req_to_token.index_select(0, fb.req_pool_indices)[:, :max_len]
            arange = torch.arange(max_len, device=rows.device)
            valid = arange.unsqueeze(0) < fb.seq_lens.unsqueeze(1)  # [batch, max_len]
            self._decode_index = torch.where(valid, rows, torch.zeros_like(rows))
            self._decode_mask = valid[:, None, None, :]
        else:
            rows = fb.req_pool_indices.tolist()
            self._extend_slots = [
                req_to_token[row, :seq_len] if prefix > 0 else None  # type: ignore[misc]
                for row, seq_len, prefix in zip(rows, fb.seq_lens_cpu, fb.extend_prefix_lens_cpu)
            ]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerInfo,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        gqa = layer.num_heads != layer.num_kv_heads
        if fb.mode is ForwardMode.DECODE:
            assert self._decode_index is not None and self._decode_mask is not None
            batch, max_len = self._decode_index.shape
            flat = self._decode_index.reshape(-1)
            # [batch, kv_heads, max_len, head_dim]
            keys = k_buf.index_select(0, flat).view(batch, max_len, -1, layer.head_dim)
            values = v_buf.index_select(0, flat).view(batch, max_len, -1, layer.head_dim)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2),  # [batch, heads, 1, head_dim]
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=self._decode_mask,
                scale=layer.scaling,
                enable_gqa=gqa,
            )
            return out.squeeze(2)

        out = torch.empty_like(q)
        start = 0
        for i, n_new in enumerate(fb.extend_seq_lens_cpu):
            end = start + n_new
            slots = self._extend_slots[i]
            q_i = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, new, head_dim]
            if slots is None:  # no cached prefix: the new tokens are the whole sequence
                keys, values = k[start:end], v[start:end]
                mask, causal = None, True
            else:
                keys, values = k_buf.index_select(0, slots), v_buf.index_select(0, slots)
                prefix = fb.extend_prefix_lens_cpu[i]
                # [new, seq_len]: token e (at position prefix + e) sees keys [0, prefix + e].
                cols = torch.arange(keys.shape[0], device=q.device)
                rows = torch.arange(n_new, device=q.device) + prefix
                mask, causal = cols[None, :] <= rows[:, None], False
            o = F.scaled_dot_product_attention(
                q_i,
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=layer.scaling,
                enable_gqa=gqa,
            )
            out[start:end] = o.squeeze(0).transpose(0, 1)
            start = end
        return out
