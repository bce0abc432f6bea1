"""Split-KV decode attention vs its torch reference (tolerances: kernel_testing.py)."""

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

from genserve.kernels.decode_attention import (
    choose_num_kv_splits,
    decode_attention_fwd,
    decode_attention_ref,
)

# Three requests of different lengths in one batch: sequence lengths 1, 17 and 64.
LENS = [1, 17, 64]


def _run(lens, heads, head_dim, dtype, splits, seed=0, q=None):
    hq, hkv = heads
    k_buf, v_buf = kv_pool(160, hkv, head_dim, dtype, seed)
    indptr, indices = scattered_slots(lens, 160, seed)
    if q is None:
        q = randn(len(lens), hq, head_dim, dtype=dtype, seed=seed + 1)
    o = torch.full((len(lens), hq, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    scale = head_dim**-0.5
    decode_attention_fwd(q, k_buf, v_buf, o, indptr, indices, scale, splits)
    return o, decode_attention_ref(q, k_buf, v_buf, indptr, indices, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim"), list(itertools.product(HEAD_CONFIGS, HEAD_DIMS)))
def test_decode_matches_reference(heads, head_dim, dtype):
    o, ref = _run(LENS, heads, head_dim, dtype, splits=None)
    assert_close(o, ref, ATTN_TOL[dtype])


@pytest.mark.parametrize("splits", [1, 2, 4, 5])
def test_split_count_does_not_change_result(splits):
    # 4 and 5 splits leave the 1-token request with empty splits (lse = -inf, weight 0); 5 is
    # not a power of two, so the merge kernel sees masked split slots.
    o, ref = _run(LENS, (6, 2), 64, torch.float32, splits)
    assert_close(o, ref, ATTN_TOL[torch.float32])


def test_mqa_with_many_heads_and_strided_query():
    # 16 query heads on one KV head: heads_per_program reaches its cap; q is a view into a
    # fused qkv projection (token stride larger than heads * head_dim).
    qkv = randn(3, 18, 64, dtype=torch.float32, seed=5)
    o, ref = _run(LENS, (16, 1), 64, torch.float32, splits=2, q=qkv[:, :16])
    assert_close(o, ref, ATTN_TOL[torch.float32])


def test_empty_request_gives_zeros():
    o, ref = _run([0, 5], (2, 2), 64, torch.float32, splits=2)
    assert torch.all(o[0] == 0)
    assert_close(o, ref, ATTN_TOL[torch.float32])


def test_choose_num_kv_splits_is_bounded_power_of_two():
    for max_len in (1, 100, 5000, 100_000):
        for batch in (1, 7, 64):
            n = choose_num_kv_splits(max_len, batch, 8, DEVICE)
            assert 1 <= n <= 16 and n & (n - 1) == 0
    # A single 1-token request never gets split.
    assert choose_num_kv_splits(1, 1, 1, DEVICE) == 1


def test_wrapper_rejects_bad_arguments():
    k_buf, v_buf = kv_pool(8, 2, 64, torch.float32)
    indptr = torch.tensor([0, 2], device=DEVICE)
    indices = torch.tensor([1, 2], device=DEVICE)
    q = randn(1, 3, 64, dtype=torch.float32, seed=0)
    o = torch.empty_like(q)
    with pytest.raises(ValueError, match="multiple"):  # 3 query heads on 2 KV heads
        decode_attention_fwd(q, k_buf, v_buf, o, indptr, indices, 0.1)
    q = randn(1, 4, 64, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="shape"):
        decode_attention_fwd(q, k_buf, v_buf, o, indptr, indices, 0.1)
    o = torch.empty_like(q)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention_fwd(q, k_buf, v_buf, o, indptr, indices.float(), 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        decode_attention_fwd(
            q, k_buf.transpose(1, 2).contiguous().transpose(1, 2), v_buf, o, indptr, indices, 0.1
        )
    with pytest.raises(ValueError, match="kv_indptr"):
        decode_attention_fwd(q, k_buf, v_buf, o, indptr[:1], indices, 0.1)


def test_tensor_core_path(monkeypatch):
    # On the GPU, bf16/fp16 run tl.dot on 16-bit operands (probabilities rounded to 16 bits);
    # the interpreter normally upcasts (its bf16 dot is broken), so force the GPU path in fp16,
    # whose dot the interpreter computes correctly.
    import genserve.kernels.decode_attention as decode_attention

    monkeypatch.setattr(decode_attention, "use_fp32_dot", lambda dtype: False)
    o, ref = _run(LENS, (9, 3), 80, torch.float16, splits=2)
    assert_close(o, ref, ATTN_TOL[torch.float16])
