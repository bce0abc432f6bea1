"""Extend attention (cached prefix + causal new tokens) vs its torch reference.

Tolerances: kernel_testing.py.
"""

import itertools

import pytest
import torch
from kernel_testing import (
    ATTN_TOL,
    DEVICE,
    HEAD_CONFIGS,
    HEAD_DIMS,
    assert_close,
    kv_pool,
    randn,
    scattered_slots,
)

from genserve.kernels.extend_attention import extend_attention_fwd, extend_attention_ref

# (prefix_len, extend_len) per request: sequence lengths 1, 17 and 64 appear as both prefix and
# extend lengths, including a request with no prefix and a one-token extend.
MIXED = [(0, 17), (17, 1), (64, 64), (1, 17)]


def _run(reqs, heads, head_dim, dtype, seed=0, qkv=None):
    hq, hkv = heads
    prefix = [p for p, _ in reqs]
    extend = [e for _, e in reqs]
    k_buf, v_buf = kv_pool(200, hkv, head_dim, dtype, seed)
    kv_indptr, kv_indices = scattered_slots(prefix, 200, seed)
    qo_indptr = torch.tensor([0, *extend]).cumsum(0).to(DEVICE)
    t = sum(extend)
    if qkv is None:
        q = randn(t, hq, head_dim, dtype=dtype, seed=seed + 1)
        k = randn(t, hkv, head_dim, dtype=dtype, seed=seed + 2)
        v = randn(t, hkv, head_dim, dtype=dtype, seed=seed + 3)
    else:
        q, k, v = qkv
    o = torch.full((t, hq, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    scale = head_dim**-0.5
    extend_attention_fwd(
        q, k, v, o, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, max(extend), scale
    )
    ref = extend_attention_ref(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, scale)
    return o, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim"), list(itertools.product(HEAD_CONFIGS, HEAD_DIMS)))
def test_extend_matches_reference(heads, head_dim, dtype):
    o, ref = _run(MIXED, heads, head_dim, dtype)
    assert_close(o, ref, ATTN_TOL[dtype])


def test_longer_than_one_block():
    # 100 new tokens after a 70-token prefix: several key blocks in both loops and (on the GPU)
    # several query blocks, so block-boundary masking is exercised.
    o, ref = _run([(70, 100), (0, 3)], (3, 1), 64, torch.float32)
    assert_close(o, ref, ATTN_TOL[torch.float32])


def test_strided_views_of_a_fused_qkv():
    # q/k/v sliced out of one [T, Hq + 2 * Hkv, D] projection, as a model produces them.
    t = sum(e for _, e in MIXED)
    qkv = randn(t, 6 + 2 * 2, 64, dtype=torch.float32, seed=9)
    views = (qkv[:, :6], qkv[:, 6:8], qkv[:, 8:])
    o, ref = _run(MIXED, (6, 2), 64, torch.float32, qkv=views)
    assert_close(o, ref, ATTN_TOL[torch.float32])


def test_causality_new_tokens_do_not_see_later_ones():
    # Changing the last new token's k/v must leave every earlier token's output unchanged.
    reqs = [(5, 9)]
    q = randn(9, 2, 64, dtype=torch.float32, seed=1)
    k = randn(9, 2, 64, dtype=torch.float32, seed=2)
    v = randn(9, 2, 64, dtype=torch.float32, seed=3)
    o1, _ = _run(reqs, (2, 2), 64, torch.float32, qkv=(q, k, v))
    k2, v2 = k.clone(), v.clone()
    k2[-1] += 3.0
    v2[-1] -= 3.0
    o2, _ = _run(reqs, (2, 2), 64, torch.float32, qkv=(q, k2, v2))
    assert torch.equal(o1[:-1], o2[:-1])
    assert not torch.allclose(o1[-1], o2[-1])


def test_wrapper_rejects_bad_arguments():
    k_buf, v_buf = kv_pool(8, 2, 64, torch.float32)
    q = randn(3, 4, 64, dtype=torch.float32, seed=0)
    k = randn(3, 2, 64, dtype=torch.float32, seed=1)
    o = torch.empty_like(q)
    qo = torch.tensor([0, 3], device=DEVICE)
    kv = torch.tensor([0, 0], device=DEVICE)
    idx = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="v_extend"):
        extend_attention_fwd(q, k, k[:2], o, k_buf, v_buf, qo, kv, idx, 3, 0.1)
    with pytest.raises(ValueError, match="pool buffers"):
        extend_attention_fwd(q, k, k, o, k_buf[:, :1], v_buf[:, :1], qo, kv, idx, 3, 0.1)
    with pytest.raises(ValueError, match="kv_indptr"):
        extend_attention_fwd(q, k, k, o, k_buf, v_buf, qo, kv[:1], idx, 3, 0.1)
    with pytest.raises(ValueError, match="max_extend_len"):
        extend_attention_fwd(q, k, k, o, k_buf, v_buf, qo, kv, idx, 0, 0.1)
    with pytest.raises(ValueError, match="dtype"):
        extend_attention_fwd(q.int(), k, k, o, k_buf, v_buf, qo, kv, idx, 3, 0.1)


def test_tensor_core_path(monkeypatch):
    # The GPU's 16-bit tl.dot path (see test_decode_attention.test_tensor_core_path), in fp16.
    import genserve.kernels.extend_attention as extend_attention

    monkeypatch.setattr(extend_attention, "use_fp32_dot", lambda dtype: False)
    o, ref = _run(MIXED, (9, 3), 80, torch.float16)
    assert_close(o, ref, ATTN_TOL[torch.float16])
