"""`int8_gemv`: the int8 weight-only matmul of a few rows (a decode step, a speculative verify)
on an AVX-512 CPU.

`aten._weight_int8pack_mm` reads four weight rows at a time with a prefetch one cache line
ahead within each: with a few activation rows, where every weight is read from memory once per
token, the kernel waits on memory. `int8_gemv.cpp` is that kernel's AVX-512 branch, the same
arithmetic in the same order, so its outputs are bit-identical, with the weight rows of the
blocks ahead prefetched into L2 and each block applied to all activation rows while it is
cached.

The C++ op (`torch.ops.genserve_cpu.int8_gemv`) is built on first use with torch's C++
extension builder (a C++ compiler and ninja, as `--compile` needs a compiler) into
`$GENSERVE_CACHE_DIR/cpu_kernels`; where it cannot be built or the CPU lacks AVX-512,
`available()` is False and callers keep the aten kernel. It has a fake (meta) implementation,
so a torch.compile'd decode step calls it as an extern kernel.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

from genserve import envs
from genserve.srt.device import cpu_flags

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("int8_gemv.cpp")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mfma", "-ffp-contract=off"]
# Matmuls of up to this many rows run `int8_gemv`; longer ones (prefills) keep aten's kernel.
MAX_ROWS = 8


def cpu_has_avx512() -> bool:
    return {"avx512f", "avx512bw"} <= cpu_flags()


@functools.cache
def available() -> bool:
    """Whether `torch.ops.genserve_cpu.int8_gemv` is loaded (built here on the first call)."""
    if not cpu_has_avx512():
        return False
    try:
        from torch.utils.cpp_extension import load

        # One folder per source text, which holds its own copy of the source: ninja's build
        # file names the source's path, so every checkout (a CI clone, a worktree) with the
        # same kernel shares one build instead of rebuilding at each other's path.
        code = _SOURCE.read_bytes()
        digest = hashlib.sha1(code + " ".join(_FLAGS).encode()).hexdigest()[:16]
        kernels = envs.GENSERVE_CACHE_DIR.get() / "cpu_kernels"
        build = kernels / f"torch-{torch.__version__}-{digest}"
        build.mkdir(parents=True, exist_ok=True)
        source = build / _SOURCE.name
        if not source.exists() or source.read_bytes() != code:
            tmp = build / f".{_SOURCE.name}.{os.getpid()}"
            tmp.write_bytes(code)
            tmp.replace(source)  # atomic: a concurrent build never reads half a file
        load(
            name="genserve_int8_gemv",
            sources=[str(source)],
            extra_cflags=_FLAGS,
            build_directory=str(build),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: keep the aten kernel
        logger.warning(
            "int8 gemv kernel not built (%s); batch-1 int8 matmuls use aten._weight_int8pack_mm",
            exc,
        )
        return False

    @torch.library.register_fake("genserve_cpu::int8_gemv")
    def _(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return a.new_empty(a.shape[0], w.shape[0])

    return True


def usable(qweight: torch.Tensor) -> bool:
    """Whether matmuls of a few rows with this int8 weight [out, in] can run `int8_gemv`: on a CPU,
    an input width that is a multiple of 16, and the op built."""
    return qweight.device.type == "cpu" and qweight.shape[1] % 16 == 0 and available()


def int8_gemv(a: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`aten._weight_int8pack_mm(a, qweight, scale)` for a [rows, in] bfloat16, qweight
    [out, in] int8, scale [out] bfloat16; [rows, out] bfloat16, bit-identical to it. A float32
    `a` gives `aten._weight_int8pack_mm(a.to(bfloat16), qweight, scale).float()`, bit for bit."""
    return torch.ops.genserve_cpu.int8_gemv(a.contiguous(), qweight, scale)
