"""Fused RMSNorm (+ residual) vs its reference and Hugging Face's LlamaRMSNorm.

Tolerances: kernel_testing.py (ELEMENTWISE_TOL).
"""

import pytest
import torch
from kernel_testing import DEVICE, ELEMENTWISE_TOL, assert_close, randn

from genserve.kernels.rmsnorm import rms_norm, rms_norm_ref


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("num_rows", [1, 17, 64])
@pytest.mark.parametrize("hidden", [64, 128, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(with_residual, num_rows, hidden, dtype):
    x = randn(num_rows, hidden, dtype=dtype, seed=0)
    w = randn(hidden, dtype=dtype, seed=1)
    res = randn(num_rows, hidden, dtype=dtype, seed=2) if with_residual else None
    tol = ELEMENTWISE_TOL[dtype]
    if res is None:
        assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), tol)
        return
    out, new_res = rms_norm(x, w, 1e-6, res)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-6, res)
    assert_close(new_res, ref_res, tol)
    assert_close(out, ref_out, tol)
    # The inputs are not modified in place.
    assert torch.equal(x, randn(num_rows, hidden, dtype=dtype, seed=0))


def test_reference_equals_hf_llama_rmsnorm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(80, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        hf.weight.copy_(randn(80, dtype=torch.float32, seed=3))
    x = randn(17, 80, dtype=torch.float32, seed=4)
    with torch.no_grad():
        expected = hf(x)
    assert_close(rms_norm_ref(x, hf.weight.detach(), 1e-5), expected, (1e-6, 1e-6))
    assert_close(rms_norm(x, hf.weight.detach(), 1e-5), expected, ELEMENTWISE_TOL[torch.float32])


def test_strided_rows_and_bad_arguments():
    base = randn(9, 128, dtype=torch.float32, seed=5)
    x = base[:, :64]  # row stride 128
    w = randn(64, dtype=torch.float32, seed=6)
    assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), ELEMENTWISE_TOL[torch.float32])
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:32], 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-6, residual=x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="dimensions"):
        rms_norm(x[0], w, 1e-6)
