"""The Triton fused-MoE kernel against its torch reference (under Triton's interpreter on CPU),
and end to end in a Mixtral model."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from genserve.kernels.fused_moe import align_by_expert, fused_moe, fused_moe_ref
from genserve.srt.layers.moe import FusedMoE, grouped_experts_ref, select_experts
from tests.srt.hf_equality import TINY, assert_greedy_matches_hf, save_tiny


def _inputs(tokens, experts, top_k, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize(
    "tokens,experts,top_k,hidden,inter",
    [(1, 4, 2, 32, 16), (5, 4, 1, 48, 40), (33, 8, 2, 64, 24), (70, 3, 3, 16, 80)],
)
def test_fused_moe_matches_reference_fp32(tokens, experts, top_k, hidden, inter):
    x, w13, w2, weights, ids = _inputs(tokens, experts, top_k, hidden, inter, torch.float32)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), want, atol=1e-4, rtol=1e-4)
    # The grouped torch path the CPU runs computes the same sum.
    torch.testing.assert_close(grouped_experts_ref(x, w13, w2, weights, ids), want)


def test_fused_moe_matches_reference_bf16():
    x, w13, w2, weights, ids = _inputs(17, 4, 2, 32, 32, torch.bfloat16)
    want = fused_moe_ref(x, w13, w2, weights, ids).float()
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_align_by_expert_pads_each_run_to_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    pairs, block_expert = align_by_expert(ids, 4, block_m=4)
    assert block_expert.tolist() == [0, 1, 2]
    assert pairs.tolist() == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6]


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_expert_slices_sum_to_the_whole_layer(kernel):
    # Expert parallel: 5 experts held 2 + 3 by two ranks (and 1 + 4, so that some tokens have
    # no expert on a rank); the ranks' partial outputs sum to the layer with every expert.
    tokens, experts, hidden, inter = 9, 5, 32, 16
    x, w13, w2, _, _ = _inputs(tokens, experts, 2, hidden, inter, torch.float32)
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(1))
    whole = FusedMoE(experts, 2, hidden, inter, renormalize=True, kernel=kernel)
    whole.load_state_dict({"w13": w13, "w2": w2})
    want = whole(x, logits)
    for split in (2, 1):
        out = torch.zeros_like(x)
        for start, count in ((0, split), (split, experts - split)):
            part = FusedMoE(experts, 2, hidden, inter, True, kernel, experts=(start, count))
            part.load_state_dict(
                {"w13": w13[start : start + count], "w2": w2[start : start + count]}
            )
            out += part(x, logits)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # A rank none of whose experts any token picked adds zeros.
    ids = torch.zeros(3, 1, dtype=torch.int64) + experts
    got = fused_moe(x[:3], w13, w2, torch.ones(3, 1), ids)
    assert torch.equal(got, torch.zeros_like(x[:3]))


def test_fused_moe_rejects_mismatched_shapes():
    x, w13, w2, weights, ids = _inputs(4, 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :, :8], weights, ids)


def test_mixtral_with_the_triton_moe_kernel_matches_transformers(tmp_path):
    cfg = tf.MixtralConfig(
        **TINY, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False
    )
    assert_greedy_matches_hf(save_tiny(tf.MixtralForCausalLM, cfg, tmp_path), moe_kernel="triton")
