"""The kernel grid at real sizes on a CUDA GPU (skipped without one): long contexts, many
requests, model-sized head counts, bf16/fp16/fp32. Tolerances: kernel_testing.py.
"""

import itertools

import pytest
import torch
from kernel_testing import ATTN_TOL, DEVICE, ELEMENTWISE_TOL, assert_close, kv_pool, randn

from genserve.kernels.decode_attention import decode_attention_fwd, decode_attention_ref
from genserve.kernels.extend_attention import extend_attention_fwd, extend_attention_ref
from genserve.kernels.kv_store import store_kv, store_kv_ref
from genserve.kernels.rmsnorm import rms_norm, rms_norm_ref
from genserve.kernels.rotary import apply_rotary, apply_rotary_ref

pytestmark = pytest.mark.gpu

# (num_q_heads, num_kv_heads): MHA, SmolLM2-like GQA 3, Llama-3-8B-like GQA 8.
GPU_HEADS = [(32, 32), (9, 3), (32, 4)]
GPU_HEAD_DIMS = [64, 128, 80]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
POOL_SLOTS = 40_000


def _slots(lens, seed):
    g = torch.Generator().manual_seed(seed)
    indices = torch.randperm(POOL_SLOTS - 1, generator=g)[: sum(lens)] + 1
    return torch.tensor([0, *lens]).cumsum(0).to(DEVICE), indices.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), list(itertools.product(GPU_HEADS, GPU_HEAD_DIMS)))
def test_decode_real_sizes(heads, head_dim, dtype):
    hq, hkv = heads
    lens = [1, 17, 64, 4096, 1000, 2049, 333, 8000]
    k_buf, v_buf = kv_pool(POOL_SLOTS, hkv, head_dim, dtype)
    indptr, indices = _slots(lens, 0)
    q = randn(len(lens), hq, head_dim, dtype=dtype, seed=1)
    scale = head_dim**-0.5
    for splits in (None, 1, 8):
        o = torch.empty_like(q)
        decode_attention_fwd(q, k_buf, v_buf, o, indptr, indices, scale, splits)
        ref = decode_attention_ref(q, k_buf, v_buf, indptr, indices, scale)
        assert_close(o, ref, ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), list(itertools.product(GPU_HEADS, GPU_HEAD_DIMS)))
def test_extend_real_sizes(heads, head_dim, dtype):
    hq, hkv = heads
    reqs = [(0, 1000), (3000, 500), (128, 1), (17, 2048), (4096, 64)]
    prefix, extend = [p for p, _ in reqs], [e for _, e in reqs]
    k_buf, v_buf = kv_pool(POOL_SLOTS, hkv, head_dim, dtype)
    kv_indptr, kv_indices = _slots(prefix, 0)
    qo_indptr = torch.tensor([0, *extend]).cumsum(0).to(DEVICE)
    t = sum(extend)
    q = randn(t, hq, head_dim, dtype=dtype, seed=1)
    k = randn(t, hkv, head_dim, dtype=dtype, seed=2)
    v = randn(t, hkv, head_dim, dtype=dtype, seed=3)
    o = torch.empty_like(q)
    scale = head_dim**-0.5
    extend_attention_fwd(
        q, k, v, o, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, max(extend), scale
    )
    ref = extend_attention_ref(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, scale)
    assert_close(o, ref, ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_rmsnorm_rotary_real_sizes(dtype):
    t = 3000
    k_buf, v_buf = kv_pool(POOL_SLOTS, 8, 128, dtype)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    loc = (torch.randperm(POOL_SLOTS - 1)[:t] + 1).to(DEVICE)
    k = randn(t, 8, 128, dtype=dtype, seed=1)
    v = randn(t, 8, 128, dtype=dtype, seed=2)
    store_kv(k_buf, v_buf, loc, k, v)
    store_kv_ref(k_ref, v_ref, loc, k, v)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)

    for hidden in (576, 4096, 8192):
        x = randn(t, hidden, dtype=dtype, seed=3)
        res = randn(t, hidden, dtype=dtype, seed=4)
        w = randn(hidden, dtype=dtype, seed=5)
        out, new_res = rms_norm(x, w, 1e-5, res)
        ref_out, ref_res = rms_norm_ref(x, w, 1e-5, res)
        assert torch.equal(new_res, ref_res)  # the GPU rounds to nearest, like torch
        assert_close(out, ref_out, ELEMENTWISE_TOL[dtype])

    inv_freq = 1.0 / (500000 ** (torch.arange(0, 128, 2).float() / 128))
    freqs = torch.outer(torch.arange(8192).float(), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)
    positions = torch.randint(0, 8192, (t,)).to(DEVICE)
    q = randn(t, 32, 128, dtype=dtype, seed=6)
    for is_neox in (True, False):
        q_out, k_out = apply_rotary(q, k, positions, cache, is_neox)
        q_ref, k_ref = apply_rotary_ref(q, k, positions, cache, is_neox)
        assert_close(q_out, q_ref, ELEMENTWISE_TOL[dtype])
        assert_close(k_out, k_ref, ELEMENTWISE_TOL[dtype])
