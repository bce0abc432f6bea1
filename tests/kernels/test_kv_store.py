"""KV store and kv_indices construction vs their torch references (exact: they only copy)."""

import pytest
import torch
from kernel_testing import DEVICE, kv_pool, randn

from genserve.kernels.kv_indices import build_kv_indices, build_kv_indices_ref
from genserve.kernels.kv_store import store_kv, store_kv_ref


@pytest.mark.parametrize("num_tokens", [1, 17, 64])
@pytest.mark.parametrize(("hkv", "head_dim"), [(1, 64), (2, 128), (3, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_matches_reference(num_tokens, hkv, head_dim, dtype):
    k_buf, v_buf = kv_pool(100, hkv, head_dim, dtype)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    loc = torch.randperm(99, generator=torch.Generator().manual_seed(0))[:num_tokens] + 1
    loc = loc.to(DEVICE)
    k = randn(num_tokens, hkv, head_dim, dtype=dtype, seed=1)
    v = randn(num_tokens, hkv, head_dim, dtype=dtype, seed=2)
    store_kv(k_buf, v_buf, loc, k, v)
    store_kv_ref(k_ref, v_ref, loc, k, v)
    assert torch.equal(k_buf, k_ref)
    assert torch.equal(v_buf, v_ref)


def test_store_strided_inputs_and_casts_to_pool_dtype():
    # k/v are views into a fused projection; the pool is fp32 while activations are bf16.
    kv = randn(5, 4, 64, dtype=torch.bfloat16, seed=3)
    k, v = kv[:, :2], kv[:, 2:]
    k_buf, v_buf = kv_pool(10, 2, 64, torch.float32)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    loc = torch.tensor([9, 1, 4, 7, 2], device=DEVICE)
    store_kv(k_buf, v_buf, loc, k, v)
    store_kv_ref(k_ref, v_ref, loc, k, v)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)


def test_store_rejects_mismatched_shapes():
    k_buf, v_buf = kv_pool(10, 2, 64, torch.float32)
    k = randn(3, 2, 64, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="loc"):
        store_kv(k_buf, v_buf, torch.tensor([1, 2], device=DEVICE), k, k)
    with pytest.raises(ValueError, match="pool buffers"):
        store_kv(k_buf[:, :1], v_buf[:, :1], torch.tensor([1, 2, 3], device=DEVICE), k, k)
    with pytest.raises(ValueError, match="dtype"):
        store_kv(k_buf, v_buf, torch.tensor([1.0, 2.0, 3.0], device=DEVICE), k, k)


@pytest.mark.parametrize("lens", [[1, 17, 64], [0, 5, 0], [3]])
def test_kv_indices_match_reference(lens):
    g = torch.Generator().manual_seed(0)
    req_to_token = torch.randint(1, 1000, (6, 80), generator=g).to(DEVICE)
    rows = torch.tensor([4, 0, 2][: len(lens)], device=DEVICE)
    kv_lens = torch.tensor(lens, device=DEVICE)
    indptr, indices = build_kv_indices(req_to_token, rows, kv_lens, sum(lens))
    ref_indptr, ref_indices = build_kv_indices_ref(req_to_token, rows, kv_lens)
    assert torch.equal(indptr, ref_indptr)
    assert torch.equal(indices, ref_indices)
