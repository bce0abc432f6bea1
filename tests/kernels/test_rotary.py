"""Rotary embedding (neox and GPT-J) vs its reference and Hugging Face's apply_rotary_pos_emb.

Tolerances: kernel_testing.py (ELEMENTWISE_TOL).
"""

import itertools

import pytest
import torch
from kernel_testing import DEVICE, ELEMENTWISE_TOL, HEAD_CONFIGS, HEAD_DIMS, assert_close, randn

from genserve.kernels.rotary import apply_rotary, apply_rotary_ref

MAX_POS = 128


def cos_sin_cache(rot_dim: int, max_pos: int = MAX_POS) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)


def positions(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, MAX_POS, (n,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("num_tokens", [1, 17, 64])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim"), list(itertools.product(HEAD_CONFIGS, HEAD_DIMS)))
def test_rotary_matches_reference(heads, head_dim, dtype, is_neox, num_tokens):
    hq, hkv = heads
    q = randn(num_tokens, hq, head_dim, dtype=dtype, seed=1)
    k = randn(num_tokens, hkv, head_dim, dtype=dtype, seed=2)
    pos, cache = positions(num_tokens), cos_sin_cache(head_dim)
    q_out, k_out = apply_rotary(q, k, pos, cache, is_neox)
    q_ref, k_ref = apply_rotary_ref(q, k, pos, cache, is_neox)
    assert_close(q_out, q_ref, ELEMENTWISE_TOL[dtype])
    assert_close(k_out, k_ref, ELEMENTWISE_TOL[dtype])


def test_neox_equals_hf_llama():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q = randn(17, 4, 64, dtype=torch.float32, seed=3)
    k = randn(17, 2, 64, dtype=torch.float32, seed=4)
    pos, cache = positions(17), cos_sin_cache(64)
    cos, sin = cache[pos].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # HF repeats the halves
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    q_out, k_out = apply_rotary(q, k, pos, cache, True)
    assert_close(q_out, q_hf, ELEMENTWISE_TOL[torch.float32])
    assert_close(k_out, k_hf, ELEMENTWISE_TOL[torch.float32])


def test_gptj_rotates_interleaved_pairs():
    # One token at position 1 with a single frequency pair: a 2-D rotation of (x0, x1).
    cache = torch.tensor([[1.0, 0.0], [0.6, 0.8]], device=DEVICE)  # cos, sin per position
    q = torch.tensor([[[1.0, 2.0, 5.0, 7.0]]], device=DEVICE)
    q_out, _ = apply_rotary(q, q.clone(), torch.tensor([1], device=DEVICE), cache, False)
    # Pair (1, 2) rotates; dims 2..3 lie beyond rot_dim = 2 and pass through.
    expected = torch.tensor([[[1 * 0.6 - 2 * 0.8, 2 * 0.6 + 1 * 0.8, 5.0, 7.0]]], device=DEVICE)
    assert_close(q_out, expected, (1e-6, 1e-6))


@pytest.mark.parametrize("is_neox", [True, False])
def test_partial_rotary_and_strided_inputs(is_neox):
    qkv = randn(17, 4 + 2 * 2, 80, dtype=torch.float32, seed=5)
    q, k = qkv[:, :4], qkv[:, 4:6]  # views of a fused projection
    pos, cache = positions(17), cos_sin_cache(40)  # only the first 40 of 80 dims rotate
    q_out, k_out = apply_rotary(q, k, pos, cache, is_neox)
    q_ref, k_ref = apply_rotary_ref(q, k, pos, cache, is_neox)
    assert_close(q_out, q_ref, ELEMENTWISE_TOL[torch.float32])
    assert_close(k_out, k_ref, ELEMENTWISE_TOL[torch.float32])
    assert torch.equal(q_out[..., 40:], q[..., 40:])


def test_bad_arguments():
    q = randn(3, 2, 64, dtype=torch.float32, seed=0)
    pos = positions(3)
    with pytest.raises(ValueError, match="rotary dim"):
        apply_rotary(q, q, pos, cos_sin_cache(64)[:, :63], True)
    with pytest.raises(ValueError, match="rotary dim"):
        apply_rotary(q, q, pos, torch.zeros(4, 130, device=DEVICE), True)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary(q, q, pos[:2], cos_sin_cache(64), True)
    with pytest.raises(ValueError, match="k must have shape"):
        apply_rotary(q, q[:2], pos, cos_sin_cache(64), True)
