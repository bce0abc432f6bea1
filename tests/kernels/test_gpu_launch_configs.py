"""The block sizes and element budgets the kernels use on CUDA, run under the interpreter.

On this CPU the wrappers pick interpreter-sized blocks, so the GPU's own launch configurations
(extend attention 16x32 / 128x64 / 64x32, decode BLOCK_N 32 / 64, the norm / rotary / KV-store
element budgets) would otherwise first run on a GPU. Here each wrapper is made to take its CUDA
choice (the config functions are asked for a `cuda` device) and must still match the torch
reference over shapes that span several blocks. The 16-bit paths run tl.dot on fp16 operands
as on the GPU (the interpreter computes fp16 dots correctly; its bf16 dot is broken).
"""

import pytest
import torch
from kernel_testing import ATTN_TOL, DEVICE, ELEMENTWISE_TOL, assert_close, kv_pool, randn
from test_decode_attention import _run as run_decode
from test_extend_attention import _run as run_extend
from test_rotary import cos_sin_cache, positions

import genserve.kernels.decode_attention as decode_attention
import genserve.kernels.extend_attention as extend_attention
import genserve.kernels.kv_store as kv_store
import genserve.kernels.rmsnorm as rmsnorm
import genserve.kernels.rotary as rotary

CUDA = torch.device("cuda")  # only passed to the config functions; nothing runs there


def force_cuda_config(monkeypatch, module, name: str) -> list:
    """Make `module.name(device, ...)` answer as for a CUDA device; returns what it answered."""
    choose = getattr(module, name)
    answers: list = []

    def as_on_cuda(device, *args):
        answers.append(choose(CUDA, *args))
        return answers[-1]

    monkeypatch.setattr(module, name, as_on_cuda)
    return answers


# Extend parts longer than the largest BLOCK_M (128), prefixes over several BLOCK_N.
EXTEND_REQS = [(0, 150), (70, 130), (40, 1)]


@pytest.mark.parametrize("dtype, head_dim, blocks", [
    (torch.float32, 64, (16, 32)),
    (torch.float16, 64, (128, 64)),
    (torch.float16, 160, (64, 32)),  # head_dim > 128
])
def test_extend_attention_with_the_cuda_blocks(monkeypatch, dtype, head_dim, blocks):
    answers = force_cuda_config(monkeypatch, extend_attention, "_block_sizes")
    if dtype != torch.float32:
        monkeypatch.setattr(extend_attention, "use_fp32_dot", lambda dtype: False)
    o, ref = run_extend(EXTEND_REQS, (4, 2), head_dim, dtype)
    assert [a[:2] for a in answers] == [blocks]
    assert_close(o, ref, ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype, block_n", [(torch.float32, 32), (torch.float16, 64)])
def test_decode_attention_with_the_cuda_blocks(monkeypatch, dtype, block_n):
    answers = force_cuda_config(monkeypatch, decode_attention, "_launch_config")
    if dtype != torch.float32:
        monkeypatch.setattr(decode_attention, "use_fp32_dot", lambda dtype: False)
    # Sequences over several BLOCK_N, split across programs and not.
    for splits in (1, 2):
        o, ref = run_decode([1, 20, 130], (8, 2), 128, dtype, splits=splits)
        assert_close(o, ref, ATTN_TOL[dtype])
    assert {a[0] for a in answers} == {block_n}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_with_the_cuda_budget(monkeypatch, dtype):
    answers = force_cuda_config(monkeypatch, rmsnorm, "elements_per_program")
    x, w = randn(100, 128, dtype=dtype, seed=0), randn(128, dtype=dtype, seed=1)
    res = randn(100, 128, dtype=dtype, seed=2)
    out, new_res = rmsnorm.rms_norm(x, w, 1e-6, res)
    ref_out, ref_res = rmsnorm.rms_norm_ref(x, w, 1e-6, res)
    assert answers == [4096]  # 32 rows a program: four programs and a partial one
    assert_close(new_res, ref_res, ELEMENTWISE_TOL[dtype])
    assert_close(out, ref_out, ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_with_the_cuda_budget(monkeypatch, dtype, is_neox):
    answers = force_cuda_config(monkeypatch, rotary, "elements_per_program")
    q, k = randn(37, 8, 64, dtype=dtype, seed=1), randn(37, 2, 64, dtype=dtype, seed=2)
    pos, cache = positions(37), cos_sin_cache(64)
    q_out, k_out = rotary.apply_rotary(q, k, pos, cache, is_neox)
    q_ref, k_ref = rotary.apply_rotary_ref(q, k, pos, cache, is_neox)
    assert answers == [2048]  # 4 tokens a program
    assert_close(q_out, q_ref, ELEMENTWISE_TOL[dtype])
    assert_close(k_out, k_ref, ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_store_with_the_cuda_budget(monkeypatch, dtype):
    answers = force_cuda_config(monkeypatch, kv_store, "elements_per_program")
    k_buf, v_buf = kv_pool(100, 4, 64, dtype)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    loc = (torch.randperm(99, generator=torch.Generator().manual_seed(0))[:50] + 1).to(DEVICE)
    k, v = randn(50, 4, 64, dtype=dtype, seed=1), randn(50, 4, 64, dtype=dtype, seed=2)
    kv_store.store_kv(k_buf, v_buf, loc, k, v)
    kv_store.store_kv_ref(k_ref, v_ref, loc, k, v)
    assert answers == [4096]  # 16 tokens a program
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
