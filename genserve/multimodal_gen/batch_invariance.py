"""Make a request's pixels independent of the batch it ran in (CPU).

A request's rows only meet other rows inside matrix products and convolutions, and there the
CPU kernels change their summation order with the batch: a GEMM with 1, 2 or 3 rows takes
another code path than one with 4 or more rows (which agree bit for bit), and a convolution's
blocking depends on the batch size. Rows past the last full block of `MIN_ROWS` also take a
tail path (seen with 2 threads: row 4 of a 5-row GEMM differs from the same row alone). So in
the denoiser a linear layer pads its rows up to a multiple of `MIN_ROWS` and drops the padding,
and a convolution runs one sample at a time.

Installed per module *instance* (an instance `forward` attribute, like cache-dit's hooks); no
class is patched, and modules on a GPU run unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

MIN_ROWS = 4


def _linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // max(1, x.shape[-1])
    pad = -rows % MIN_ROWS
    if x.device.type != "cpu" or rows == 0 or pad == 0:
        return F.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    padded = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    out = F.linear(padded, module.weight, module.bias)[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


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
