"""Make a request's pixels independent of the batch it ran in (CPU).

A request's rows only meet other rows inside matrix products and convolutions, and there the
CPU kernels change their summation order with the batch: a GEMM with 1, 2 or 3 rows takes
another code path than one with 4 or more rows (which agree bit for bit), and a convolution's
blocking depends on the batch size. Rows past the last full block also take a tail path (seen
with 2 threads: row 4 of a 5-row GEMM differs from the same row alone). So in the denoiser:
- a linear layer whose input holds one vector per sample ([samples, features]: the timestep and
  pooled-text embeddings that feed every block's adaLN) runs each sample as its own one-row
  product, so a request alone pays nothing (padding its one row to a whole block would cost it
  a few percent of its time; docs/benchmarks.md);
- any other linear layer pads its rows up to a multiple of `min_rows()` and drops the padding;
- a convolution runs one sample at a time.

The block depends on the CPU and the thread count: 4 rows on an AVX2 machine, 16 on an AVX-512
one (where 4- and 8-row GEMMs of some shapes differ from larger ones). `min_rows` finds it by
trying, once per thread count and dtype.

Installed per module *instance* (an instance `forward` attribute, like cache-dit's hooks); no
class is patched, and modules on a GPU run unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

CANDIDATE_ROWS = (4, 8, 16, 32, 64)
# (in, out) features of the probe GEMMs: the widths of small DiTs and text encoders.
_PROBE_SHAPES = ((128, 16), (64, 192), (192, 768), (768, 192), (256, 1024))


def _invariant(multiple: int, in_features: int, out_features: int, dtype: torch.dtype) -> bool:
    """Whether padding rows to `multiple` gives every row the same result whatever else is in
    the batch and wherever the row sits in it."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(3 * multiple + 7, in_features, generator=gen).to(dtype)

    def padded(rows: torch.Tensor) -> torch.Tensor:
        pad = -rows.shape[0] % multiple
        return F.linear(torch.cat([rows, rows.new_zeros(pad, in_features)]), w, b)

    alone = padded(x[-1:])[0]
    for offset in range(2 * multiple + 1):  # the row after `offset` others, then more rows
        for extra in (0, 5):
            rows = torch.cat([x[:offset], x[-1:], x[offset : offset + extra]])
            if not torch.equal(padded(rows)[offset], alone):
                return False
    return True


@functools.cache
def _min_rows(threads: int, dtype: torch.dtype) -> int:
    for multiple in CANDIDATE_ROWS:
        if all(_invariant(multiple, k, n, dtype) for k, n in _PROBE_SHAPES):
            return multiple
    return CANDIDATE_ROWS[-1]


def min_rows(dtype: torch.dtype = torch.float32) -> int:
    """The row multiple that makes this CPU's GEMMs batch invariant at the current thread
    count (found by trying once per thread count and dtype, then kept)."""
    return _min_rows(torch.get_num_threads(), dtype)


# The CPU allocator aligns every tensor to 64 bytes; a row viewed at another offset may take
# another vectorized path, so such a row is copied first.
_ALIGNMENT = 64


def _linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and x.device.type == "cpu":
        return _linear_per_sample(module, x)
    rows = x.numel() // max(1, x.shape[-1])
    pad = -rows % min_rows(x.dtype) if x.device.type == "cpu" and rows else 0
    if pad == 0:
        return F.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    padded = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    out = F.linear(padded, module.weight, module.bias)[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _linear_per_sample(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """[samples, features]: one one-row product per sample, on a 64-byte-aligned row."""
    outs = []
    for i in range(x.shape[0]):
        row = x[i : i + 1]
        if row.data_ptr() % _ALIGNMENT:
            row = row.clone()
        outs.append(F.linear(row, module.weight, module.bias))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _conv(module: nn.modules.conv._ConvNd, original, x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu" or x.shape[0] <= 1:
        return original(x)
    return torch.cat([original(x[i : i + 1]) for i in range(x.shape[0])])


def make_batch_invariant(model: nn.Module) -> int:
    """Install the batch-invariant forwards on every plain Linear / Conv of `model` (once).
    Returns how many modules were changed."""
    changed = 0
    for module in model.modules():
        if "forward" in vars(module):  # already wrapped (by us or another hook): leave it
            continue
        if type(module) is nn.Linear:
            module.forward = functools.partial(_linear, module)
        elif type(module) in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
            module.forward = functools.partial(_conv, module, module.forward)
        else:
            continue
        changed += 1
    return changed
