"""Paged attention in plain torch (SDPA over K/V gathered from the pool): the CPU backend and
the reference the Triton backend is checked against.

Decode is memory-bound on a CPU: gathering every request's K/V costs more than the math. When
several decoding requests share a long prefix of KV slots (a common system prompt through the
radix cache, or n > 1), the shared part is gathered and attended once for the whole group
("cascade" attention) and merged with each request's own suffix through their log-sum-exps.

Cascade runs for a float32 KV pool only. Its math is float32 (the log-sum-exp merge), where it
beats padded SDPA; with bfloat16 K/V, SDPA's own bf16 kernel beats cascade, so bf16 batches
always take the padded path (docs/benchmarks.md).

Layers with a sliding window, attention-logit soft-capping (Mistral, Gemma 2/3) or attention
sinks (GPT-OSS) take the padded path with an explicit mask, as do prefills with image blocks
that attend both ways (Gemma 3) and speculative draft trees (`ForwardBatch.tree_masks`);
soft-capping and sinks compute the scores themselves since SDPA can neither cap them nor add a
column to its softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from genserve.srt.forward_batch import ForwardBatch, ForwardMode
from genserve.srt.layers.attention.base import AttentionBackend, AttentionLayerInfo

# A shared prefix shorter than this is not worth a separate pass.
CASCADE_MIN_PREFIX = 64


@dataclass
class _CascadeGroup:
    members: torch.Tensor  # [G] rows of the batch
    prefix_slots: torch.Tensor  # [P] KV slots every member starts with
    suffix_index: torch.Tensor  # [G, S] each member's remaining slots, 0 = padding
    suffix_mask: torch.Tensor  # [G, 1, 1, S] bool


class TorchAttnBackend(AttentionBackend):
    def __init__(self) -> None:
        self._decode_index: torch.Tensor | None = None  # [batch, max_len] KV slots, 0 = padding
        self._decode_mask: torch.Tensor | None = None  # [batch, 1, 1, max_len] bool
        self._plain_rows: torch.Tensor | None = None  # decode rows not in a cascade group
        self._groups: list[_CascadeGroup] = []
        self._extend_slots: list[torch.Tensor] = []  # per request: [seq_len] KV slots
        # per request: (mask, key positions, query positions) of its extend, or None
        self._extend_masks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = []
        # Every decode row, for layers that cannot use the cascade plan (window, soft-cap).
        self._full_index: torch.Tensor | None = None  # [batch, max_len]
        self._full_valid: torch.Tensor | None = None  # [batch, max_len] bool
        self._seq_lens: torch.Tensor | None = None  # [batch]
        self._uniform = False  # every decode row has the same length
        # Set by the runner under --compile: the decode index's length is marked dynamic, so
        # the compiled decode step is traced once for every sequence length with every other
        # size static (fewer symbols and guards than compiling everything dynamic).
        self.dynamic_decode_len = False

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        req_to_token = fb.req_to_token_pool.req_to_token
        if fb.mode is ForwardMode.DECODE:
            max_len = max(fb.seq_lens_cpu)
            rows = req_to_token.index_select(0, fb.req_pool_indices)[:, :max_len]
            arange = torch.arange(max_len, device=rows.device)
            valid = arange.unsqueeze(0) < fb.seq_lens.unsqueeze(1)  # [batch, max_len]
            index = torch.where(valid, rows, torch.zeros_like(rows))
            if self.dynamic_decode_len:
                torch._dynamo.mark_dynamic(index, 1)
                # The masked path (windows, soft-caps, sinks) reads the validity mask too: left
                # static, its length would contradict the index's dynamic one.
                torch._dynamo.mark_dynamic(valid, 1)
            self._full_index, self._full_valid, self._seq_lens = index, valid, fb.seq_lens
            # Rows of one length (always at batch 1) need no padding mask: SDPA then runs its
            # unmasked kernel.
            self._uniform = min(fb.seq_lens_cpu) == max_len
            if fb.token_to_kv_pool.dtype == torch.float32:
                self._plan_cascade(index, valid, fb.seq_lens_cpu)
            else:
                self._plan_plain(index, valid)
        else:
            rows = fb.req_pool_indices.tolist()
            self._extend_slots = [
                req_to_token[row, :seq_len] if prefix > 0 else None  # type: ignore[misc]
                for row, seq_len, prefix in zip(rows, fb.seq_lens_cpu, fb.extend_prefix_lens_cpu)
            ]
            # Each request's mask is the same in every layer (but a sliding window's cut): built
            # once per forward, not per layer (an eager verify has 30 layers); a plain prefill's
            # only where a layer needs one (`forward`).
            blocks = fb.image_blocks or [None] * fb.batch_size
            trees = fb.tree_masks or [None] * fb.batch_size
            self._extend_masks = [
                self._extend_mask(fb, i)
                if prefix > 0 or blocks[i] or trees[i] is not None
                else None
                for i, prefix in enumerate(fb.extend_prefix_lens_cpu)
            ]

    def _extend_mask(
        self, fb: ForwardBatch, i: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mask [new, seq_len] bool, key positions [seq_len], query positions [new]) of request
        i's extend: token e (at position prefix + e) sees keys [0, prefix + e] and, inside an
        image block, the whole block. A draft tree's token sees the prefix and its ancestors;
        its position is prefix + its depth."""
        device = fb.input_ids.device
        start = sum(fb.extend_seq_lens_cpu[:i])
        n_new, prefix = fb.extend_seq_lens_cpu[i], fb.extend_prefix_lens_cpu[i]
        cols = torch.arange(prefix + n_new, device=device)
        rows = torch.arange(n_new, device=device) + prefix
        mask = cols[None, :] <= rows[:, None]
        for lo, hi in fb.image_blocks[i] if fb.image_blocks is not None else ():
            in_rows, in_cols = (rows >= lo) & (rows < hi), (cols >= lo) & (cols < hi)
            mask |= in_rows[:, None] & in_cols[None, :]
        tree = fb.tree_masks[i] if fb.tree_masks is not None else None
        if tree is not None:
            mask[:, prefix:] = tree
            rows = fb.positions[start : start + n_new]
            cols = torch.cat([cols[:prefix], rows])
        return mask, cols, rows

    def _plan_plain(self, index: torch.Tensor, valid: torch.Tensor) -> None:
        self._groups, self._plain_rows = [], None
        self._decode_index = index
        self._decode_mask = None if self._uniform else valid[:, None, None, :]

    def _plan_cascade(self, index: torch.Tensor, valid: torch.Tensor, seq_lens: list[int]) -> None:
        # Requests holding the same KV slot at column K - 1 (K = CASCADE_MIN_PREFIX) share the
        # whole K-token prefix: a slot belongs to one radix-tree path. Keying on the first slot
        # instead put every request in one group whenever all prompts start alike (a BOS token,
        # a chat template's opening), whose common prefix was then those few tokens.
        k = CASCADE_MIN_PREFIX
        groups: dict[int, list[int]] = {}
        plain: list[int] = []
        if index.shape[1] > k:
            for i, slot in enumerate(index[:, k - 1].tolist()):
                if seq_lens[i] > k:
                    groups.setdefault(slot, []).append(i)
                else:
                    plain.append(i)
        else:
            plain = list(range(index.shape[0]))
        self._groups = []
        for members in groups.values():
            if len(members) < 2:
                plain.extend(members)
                continue
            sub = index[members]
            # Leading columns where every member holds the same slot.
            same = (sub == sub[:1]).all(0).to(torch.int64).cumprod(0)
            common = min(int(same.sum()), min(seq_lens[i] for i in members) - 1)
            if common < CASCADE_MIN_PREFIX:
                plain.extend(members)
                continue
            width = max(seq_lens[i] for i in members) - common
            self._groups.append(
                _CascadeGroup(
                    members=torch.tensor(members, device=index.device),
                    prefix_slots=sub[0, :common],
                    suffix_index=sub[:, common : common + width],
                    suffix_mask=valid[members, common : common + width][:, None, None, :],
                )
            )
        plain.sort()
        if len(plain) == index.shape[0]:
            self._plan_plain(index, valid)  # everyone: no indexing needed
        elif plain:
            rows = torch.tensor(plain, device=index.device)
            width = max(seq_lens[i] for i in plain)
            self._plain_rows = rows
            self._decode_index = index[rows, :width]
            self._decode_mask = valid[rows, :width][:, None, None, :]
        else:
            self._plain_rows, self._decode_index, self._decode_mask = None, None, None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerInfo,
        fb: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if layer.sinks and sinks is None:
            raise ValueError(f"layer {layer.layer_id} has attention sinks but none were passed")
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        gqa = layer.num_heads != layer.num_kv_heads
        special = (layer.sliding_window is not None or layer.logit_softcap is not None
                   or layer.sinks)
        if fb.mode is ForwardMode.DECODE and special:
            return self._decode_masked(q, k_buf, v_buf, layer, sinks)
        if fb.mode is ForwardMode.DECODE:
            if not self._groups:
                return self._decode_padded(q, k_buf, v_buf, layer, gqa)
            out = q.new_empty(*q.shape[:-1], layer.value_dim)
            if self._decode_index is not None:
                rows = self._plain_rows
                out[rows] = self._decode_padded(q[rows], k_buf, v_buf, layer, gqa)
            for group in self._groups:
                out[group.members] = self._decode_cascade(
                    q[group.members], k_buf, v_buf, layer, group
                )
            return out

        out = q.new_empty(*q.shape[:-1], layer.value_dim)
        start = 0
        for i, n_new in enumerate(fb.extend_seq_lens_cpu):
            end = start + n_new
            slots = self._extend_slots[i]
            q_i = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, new, head_dim]
            if slots is None:  # no cached prefix: the new tokens are the whole sequence
                keys, values = k[start:end], v[start:end]
            else:
                keys, values = k_buf.index_select(0, slots), v_buf.index_select(0, slots)
            blocks = fb.image_blocks[i] if fb.image_blocks is not None else None
            tree = fb.tree_masks[i] if fb.tree_masks is not None else None
            if slots is None and not special and not blocks and tree is None:
                mask, causal = None, True
            else:
                # [new, seq_len] (`_extend_mask`); in a sliding-window layer only the keys in
                # (prefix + e - window, ...) of those.
                if self._extend_masks[i] is None:
                    self._extend_masks[i] = self._extend_mask(fb, i)
                mask, cols, rows = self._extend_masks[i]  # type: ignore[misc]
                causal = False
                if layer.sliding_window is not None:
                    mask = mask & (cols[None, :] > rows[:, None] - layer.sliding_window)
            o = _attend(
                q_i,
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                mask,
                causal,
                layer,
                sinks,
            )
            out[start:end] = o.squeeze(0).transpose(0, 1)
            start = end
        return out

    def _decode_masked(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        index, valid = self._full_index, self._full_valid
        assert index is not None and valid is not None and self._seq_lens is not None
        batch, max_len = index.shape
        mask = valid
        if layer.sliding_window is not None:
            # The new token sits at position seq_len - 1.
            cols = torch.arange(max_len, device=index.device)
            mask = mask & (cols[None, :] >= self._seq_lens[:, None] - layer.sliding_window)
        flat = index.reshape(-1)
        keys = k_buf.index_select(0, flat).view(batch, max_len, -1, layer.head_dim)
        values = v_buf.index_select(0, flat).view(batch, max_len, -1, layer.value_dim)
        out = _attend(
            q.unsqueeze(2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            mask[:, None, None, :],
            False,
            layer,
            sinks,
        )
        return out.squeeze(2)

    def _decode_padded(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer, gqa: bool
    ) -> torch.Tensor:
        assert self._decode_index is not None
        batch, max_len = self._decode_index.shape
        flat = self._decode_index.reshape(-1)
        # [batch, kv_heads, max_len, head_dim]
        keys = k_buf.index_select(0, flat).view(batch, max_len, -1, layer.head_dim)
        values = v_buf.index_select(0, flat).view(batch, max_len, -1, layer.value_dim)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [batch, heads, 1, head_dim]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=self._decode_mask,
            scale=layer.scaling,
            enable_gqa=gqa,
        )
        return out.squeeze(2)

    @staticmethod
    def _decode_cascade(
        q: torch.Tensor,  # [G, heads, head_dim]
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        layer: AttentionLayerInfo,
        group: _CascadeGroup,
    ) -> torch.Tensor:
        g, hkv, d, dv = q.shape[0], layer.num_kv_heads, layer.head_dim, layer.value_dim
        per = layer.num_heads // hkv
        qf = q.float().view(g, hkv, per, d)
        # Shared prefix, gathered once: [kv_heads, P, head_dim].
        kp = k_buf.index_select(0, group.prefix_slots).float().transpose(0, 1)
        vp = v_buf.index_select(0, group.prefix_slots).float().transpose(0, 1)
        # Every member's queries of one kv head in one matmul: [kv_heads, G * per, P].
        qp = qf.permute(1, 0, 2, 3).reshape(hkv, g * per, d)
        s1 = torch.matmul(qp, kp.transpose(1, 2)) * layer.scaling
        lse1 = torch.logsumexp(s1, dim=-1, keepdim=True)
        o1 = torch.matmul(torch.exp(s1 - lse1), vp)  # [kv_heads, G * per, value_dim]
        o1 = o1.view(hkv, g, per, dv).permute(1, 0, 2, 3)  # [G, kv_heads, per, value_dim]
        lse1 = lse1.view(hkv, g, per, 1).permute(1, 0, 2, 3)
        # Each member's own suffix: [G, kv_heads, S, head_dim].
        s_len = group.suffix_index.shape[1]
        flat = group.suffix_index.reshape(-1)
        ks = k_buf.index_select(0, flat).float().view(g, s_len, hkv, d).transpose(1, 2)
        vs = v_buf.index_select(0, flat).float().view(g, s_len, hkv, dv).transpose(1, 2)
        s2 = torch.matmul(qf, ks.transpose(2, 3)) * layer.scaling  # [G, kv_heads, per, S]
        s2 = s2.masked_fill(~group.suffix_mask, float("-inf"))
        lse2 = torch.logsumexp(s2, dim=-1, keepdim=True)
        o2 = torch.matmul(torch.exp(s2 - lse2), vs)
        # Merge the two partial softmaxes by their log-sum-exps.
        m = torch.maximum(lse1, lse2)
        w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
        o = (o1 * w1 + o2 * w2) / (w1 + w2)
        return o.reshape(g, layer.num_heads, dv).to(q.dtype)


def _attend(
    q: torch.Tensor,  # [B, heads, Lq, head_dim]
    k: torch.Tensor,  # [B, kv_heads, Lk, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # bool, broadcastable to [B, heads, Lq, Lk]
    causal: bool,
    layer: AttentionLayerInfo,
    sinks: torch.Tensor | None = None,  # [heads]
) -> torch.Tensor:
    gqa = layer.num_heads != layer.num_kv_heads
    if layer.logit_softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=layer.scaling, enable_gqa=gqa
        )
    if gqa:
        rep = layer.num_heads // layer.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * layer.scaling
    cap = layer.logit_softcap
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if causal:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)
    # The sink is one more softmax column per head; its probability is dropped (it has no
    # value row), so every row's weights sum to less than one.
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)
    return torch.matmul(probs[..., :-1].to(q.dtype), v)
