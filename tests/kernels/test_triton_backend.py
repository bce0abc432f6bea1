"""TritonAttnBackend on the real KV pools vs a dense torch computation, for a mixed EXTEND batch
(some requests with a cached prefix) followed by a DECODE batch, over two layers.

Tolerances: kernel_testing.py (ATTN_TOL).
"""

import pytest
import torch
from kernel_testing import ATTN_TOL, DEVICE, assert_close, randn

from genserve.srt.forward_batch import ForwardBatch, ForwardMode
from genserve.srt.layers.attention.base import AttentionLayerInfo
from genserve.srt.layers.attention.triton_backend import TritonAttnBackend
from genserve.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

NUM_LAYERS = 2


def _batch(mode, rows, prefix, extend, out_cache_loc, pools, backend):
    req_pool, kv_pool = pools
    seq = [p + e for p, e in zip(prefix, extend, strict=True)]
    positions = [p + j for p, e in zip(prefix, extend, strict=True) for j in range(e)]
    starts = [sum(extend[:i]) for i in range(len(extend))]
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)
    return ForwardBatch(
        mode=mode,
        batch_size=len(rows),
        input_ids=torch.zeros(sum(extend), dtype=torch.int64, device=DEVICE),
        positions=as_tensor(positions),
        out_cache_loc=out_cache_loc,
        req_pool_indices=as_tensor(rows),
        seq_lens=as_tensor(seq),
        extend_prefix_lens=as_tensor(prefix),
        extend_seq_lens=as_tensor(extend),
        extend_start_loc=as_tensor(starts),
        seq_lens_cpu=seq,
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=extend,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
        attn_backend=backend,
    )


def _dense_attention(q, keys, values, prefix, scale):
    """q [n, Hq, D] at positions prefix.. prefix + n - 1; keys/values [prefix + n, Hkv, D]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1)
    v = values.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    visible = torch.arange(k.shape[0])[None, :] <= (torch.arange(q.shape[0]) + prefix)[:, None]
    scores = scores.masked_fill(~visible.to(DEVICE), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    ("hq", "hkv", "head_dim", "dtype"),
    [(6, 2, 64, torch.float32), (8, 1, 80, torch.bfloat16), (3, 3, 128, torch.float32)],
)
def test_extend_then_decode_matches_dense_attention(hq, hkv, head_dim, dtype):
    req_pool = ReqToTokenPool(4, 128, DEVICE)
    kv_pool = MHATokenToKVPool(256, dtype, NUM_LAYERS, hkv, head_dim, DEVICE)
    backend = TritonAttnBackend(hq, hkv, head_dim, DEVICE)
    layers = [AttentionLayerInfo(i, hq, hkv, head_dim, head_dim**-0.5) for i in range(NUM_LAYERS)]
    rows = [2, 0, 3]
    prefix, extend = [17, 0, 64], [5, 17, 1]
    g = torch.Generator().manual_seed(0)
    free_slots = (torch.randperm(256, generator=g) + 1).to(DEVICE)  # slot 0 is padding
    # Full K/V history per request and layer, [seq_len, Hkv, D], kept for the dense check.
    history = {}
    used = 0
    for i, row in enumerate(rows):
        slots = free_slots[used : used + prefix[i] + extend[i]]
        used += slots.numel()
        req_pool.write(row, 0, slots)
        for layer in range(NUM_LAYERS):
            k = randn(prefix[i], hkv, head_dim, dtype=dtype, seed=100 * i + layer)
            v = randn(prefix[i], hkv, head_dim, dtype=dtype, seed=100 * i + layer + 50)
            kv_pool.set_kv_buffer(layer, slots[: prefix[i]], k, v)
            history[i, layer] = (k, v)

    def step(mode, prefix, extend, seed):
        cols = [torch.arange(p, p + e) for p, e in zip(prefix, extend, strict=True)]
        loc = torch.cat([req_pool.req_to_token[r, c] for r, c in zip(rows, cols, strict=True)])
        fb = _batch(mode, rows, prefix, extend, loc, (req_pool, kv_pool), backend)
        backend.init_forward_metadata(fb)
        t = sum(extend)
        for layer in layers:
            q = randn(t, hq, head_dim, dtype=dtype, seed=seed + layer.layer_id)
            k = randn(t, hkv, head_dim, dtype=dtype, seed=seed + 10 + layer.layer_id)
            v = randn(t, hkv, head_dim, dtype=dtype, seed=seed + 20 + layer.layer_id)
            out = backend.forward(q, k, v, layer, fb)
            assert out.shape == (t, hq, head_dim) and out.dtype == dtype
            # The new K/V landed in the pool at out_cache_loc.
            assert torch.equal(kv_pool.get_key_buffer(layer.layer_id)[loc], k)
            assert torch.equal(kv_pool.get_value_buffer(layer.layer_id)[loc], v)
            start = 0
            for i in range(len(rows)):
                new = slice(start, start + extend[i])
                old_k, old_v = history[i, layer.layer_id]
                keys, values = torch.cat([old_k, k[new]]), torch.cat([old_v, v[new]])
                history[i, layer.layer_id] = (keys, values)
                expected = _dense_attention(q[new], keys, values, prefix[i], layer.scaling)
                assert_close(out[new], expected, ATTN_TOL[dtype])
                start += extend[i]

    step(ForwardMode.EXTEND, prefix, extend, seed=1000)
    seq = [p + e for p, e in zip(prefix, extend, strict=True)]
    for i, row in enumerate(rows):  # the scheduler's job: a slot for each request's next token
        req_pool.write(row, seq[i], free_slots[used + i : used + i + 1])
    step(ForwardMode.DECODE, seq, [1, 1, 1], seed=2000)


def test_backend_rejects_misuse():
    with pytest.raises(ValueError, match="multiple"):
        TritonAttnBackend(6, 4, 64, DEVICE)
    with pytest.raises(ValueError, match="positive"):
        TritonAttnBackend(0, 1, 64, DEVICE)
    backend = TritonAttnBackend(2, 2, 64, DEVICE)
    q = torch.zeros(1, 2, 64, device=DEVICE)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backend.forward(q, q, q, AttentionLayerInfo(0, 2, 2, 64, 0.125), None)  # type: ignore
