"""Make a request's pixels independent of the batch it ran in (CPU).

A request's rows only meet other rows inside matrix products and convolutions, and there the
CPU kernels change their summation order with the batch: a GEMM with 1, 2 or 3 rows takes
another code path than one with 4 or more rows (which agree bit for bit), and a convolution's
blocking depends on the batch size. So in the denoiser, a linear layer on fewer than
`MIN_ROWS` rows (the timestep / modulation projections of a batch of 1-3) pads its input to
`MIN_ROWS` rows and drops the padding, and a convolution runs one sample at a time.

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
    if x.device.type != "cpu" or not 0 < rows < MIN_ROWS:
        return F.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    padded = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[1])])
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
