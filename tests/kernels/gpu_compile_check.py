"""Compile every kernel the wrappers launch for an NVIDIA sm_90 target, without a GPU.

Run as a script in a process where TRITON_INTERPRET is unset (test_gpu_compile.py does that).
Triton's interpreter accepts programs the GPU compiler rejects (a block size that is not a
power of two, mismatched loop-carried types, too much shared memory), so the CPU tests alone
would let such a bug reach the first GPU user. Here each wrapper runs its real argument checks
and launch-configuration choices for a "cuda" device, and the launch itself is replaced by
`triton.compile(..., target=sm_90)` (Triton ships ptxas, so the compile goes down to a cubin).

Hacks, confined to this process: tensors report device "cuda" while living on the CPU, and the
wrappers' `torch.empty`/`torch.zeros` ignore the device argument.
Prints one line per failure and exits 1 if any launch failed to compile.
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED_BYTES = 227 * 1024  # H100/H200 per-block limit
SIG_TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int64: "i64",
    torch.int32: "i32",
}
failures: list[str] = []
compiled: list[str] = []


def compile_instead_of_launch(self, *args, grid, warmup, **kwargs):
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(self.arg_names, args, strict=False)) | kwargs
    constexpr_idx = {p.num for p in self.params if p.is_constexpr}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(self.arg_names):
        value = values[name]
        aligned = False
        if i in constexpr_idx:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + SIG_TYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            aligned = value % 16 == 0
        else:
            signature[name] = "fp32"
        # Like a real launch: 16-aligned pointers and multiples of 16 are specialised, which is
        # what lets the compiler vectorise loads.
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    label = f"{self.__name__} {constexprs} {options}"
    try:
        kernel = triton.compile(
            ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options
        )
    except Exception as e:  # report every failing launch, not just the first
        failures.append(f"{label}: {type(e).__name__}: {e}")
        return
    if kernel.metadata.shared > MAX_SHARED_BYTES:
        failures.append(f"{label}: needs {kernel.metadata.shared} bytes of shared memory")
    compiled.append(label)


class _CpuAllocatingTorch:
    """`torch` for the wrapper modules: allocations ignore `device=` (there is no CUDA)."""

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in ("empty", "zeros", "full"):
            return lambda *a, device=None, **kw: attr(*a, **kw)
        return attr


def main() -> int:
    from genserve.kernels import (
        _checks,
        decode_attention,
        extend_attention,
        kv_indices,
        kv_store,
        rmsnorm,
        rotary,
    )

    if _checks.interpreting():
        print("run without TRITON_INTERPRET", file=sys.stderr)
        return 2
    modules = (decode_attention, extend_attention, kv_indices, kv_store, rmsnorm, rotary)
    for module in modules:
        module.check_launchable = lambda device: None
        module.torch = _CpuAllocatingTorch()
    JITFunction.run = compile_instead_of_launch
    torch.cuda.get_device_properties = lambda d: type("P", (), {"multi_processor_count": 132})
    torch.Tensor.device = property(lambda self: torch.device("cuda"))

    cases = [(torch.bfloat16, 32, 4, 128), (torch.bfloat16, 9, 3, 80), (torch.float32, 8, 8, 128)]
    for dtype, hq, hkv, d in cases:
        t, slots = 40, 100
        q = torch.randn(t, hq, d, dtype=dtype)
        k = torch.randn(t, hkv, d, dtype=dtype)
        k_buf = torch.randn(slots, hkv, d, dtype=dtype)
        indptr = torch.tensor([0, 20, 40])
        indices = torch.arange(40)
        decode_attention.decode_attention_fwd(
            q[:2], k_buf, k_buf, torch.empty_like(q[:2]), indptr, indices, 0.1, 4
        )
        extend_attention.extend_attention_fwd(
            q,
            k,
            k,
            torch.empty_like(q),
            k_buf,
            k_buf,
            indptr,
            torch.tensor([0, 5, 10]),
            indices[:10],
            20,
            0.1,
        )
        kv_store.store_kv(k_buf, k_buf, torch.arange(t), k, k)
        rotary.apply_rotary(q, k, torch.arange(t), torch.randn(50, d), True)
        rotary.apply_rotary(q, k, torch.arange(t), torch.randn(50, d), False)
        # 4 + 1 heads: the per-token tile is not a power of two, nor may the token block be.
        rotary.apply_rotary(q[:, :4], k[:, :1], torch.arange(t), torch.randn(50, d), True)
        x = torch.randn(8, hq * d, dtype=dtype)
        rmsnorm.rms_norm(x, torch.randn(hq * d, dtype=dtype), 1e-6, x)
    kv_indices.build_kv_indices(
        torch.zeros(4, 64, dtype=torch.int64), torch.arange(2), torch.tensor([3, 4]), 7
    )
    for line in failures:
        print(line)
    print(f"{len(compiled)} launches compiled for sm_90, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
