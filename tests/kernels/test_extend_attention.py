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


def _run(reqs, heads, head_dim, dtype, seed=0, qkv=None, masks=None):
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
    custom = indptr = None
    if masks is not None:  # one [e, e] bool mask per request
        custom = torch.cat([m.reshape(-1) for m in masks]).to(DEVICE)
        indptr = torch.tensor([0, *(e * e for e in extend)]).cumsum(0).to(DEVICE)
    extend_attention_fwd(
        q,
        k,
        v,
        o,
        k_buf,
        v_buf,
        qo_indptr,
        kv_indptr,
        kv_indices,
        max(extend),
        scale,
        custom,
        indptr,
    )
    ref = extend_attention_ref(
        q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, scale, custom, indptr
    )
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


def _tree_mask(parents: list[int]) -> torch.Tensor:
    """[1 + n, 1 + n] ancestor mask of a draft tree (row 0 the root; node i's parent is
    parents[i], -1 = the root), as speculative verification builds it."""
    from genserve.srt.speculative.tree import DraftTree, ancestor_mask

    return ancestor_mask(DraftTree(tuple(range(len(parents))), tuple(parents)), DEVICE).cpu()


# A root with three branches of depths 3, 2 and 1 (11 nodes), and a 70-node tree whose nodes
# hang off earlier nodes at random: several key blocks, masked in the unmasked-causal loop too.
BRANCHY = [-1, 0, 1, -1, 3, 4, -1, 6, 2, 2, 5]


def test_tree_mask_matches_reference():
    g = torch.Generator().manual_seed(3)
    deep = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, 70)]
    reqs = [(9, 12), (0, 4), (70, 71)]
    masks = [_tree_mask(BRANCHY), torch.ones(4, 4, dtype=torch.bool).tril(), _tree_mask(deep)]
    for dtype in (torch.float32, torch.bfloat16):
        o, ref = _run(reqs, (6, 2), 64, dtype, masks=masks)
        assert_close(o, ref, ATTN_TOL[dtype])


def test_tree_mask_hides_other_branches():
    # A node's output depends on its ancestors only: changing another branch's k/v leaves it.
    reqs = [(5, 12)]
    q = randn(12, 2, 64, dtype=torch.float32, seed=1)
    k = randn(12, 2, 64, dtype=torch.float32, seed=2)
    v = randn(12, 2, 64, dtype=torch.float32, seed=3)
    mask = [_tree_mask(BRANCHY)]
    o1, ref1 = _run(reqs, (2, 2), 64, torch.float32, qkv=(q, k, v), masks=mask)
    k2, v2 = k.clone(), v.clone()
    k2[4], v2[4] = k2[4] + 3.0, v2[4] - 3.0  # node 3 (row 4): the second branch's first node
    o2, _ = _run(reqs, (2, 2), 64, torch.float32, qkv=(q, k2, v2), masks=mask)
    second = [4, 5, 6, 11]  # node 3 and its descendants 4, 5 and 10
    others = [r for r in range(12) if r not in second]
    assert torch.equal(o1[others], o2[others])
    assert not torch.allclose(o1[second], o2[second])
    # Without the mask the same rows would see the causal past, so the tree mask mattered.
    causal, _ = _run(reqs, (2, 2), 64, torch.float32, qkv=(q, k, v))
    assert not torch.allclose(causal[7], ref1[7])
