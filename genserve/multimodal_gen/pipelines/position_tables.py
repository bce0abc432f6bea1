"""Position tables computed once per shape instead of once per call or per step.

Two pieces of the supported pipelines rebuild, from positions alone, a table that only changes
with the shape of the input:
- Flux's rotary embedding: the cos and sin of every text and image position (in float64),
  rebuilt at every denoising step from position ids that are the same at every step, and in
  every call of one size;
- T5's relative position bias (the text encoder of Flux, SD3 and LTX; UMT5 in Wan): the bucket
  of every query/key distance (a log per pair, 512 x 512 pairs for Flux's 512-token prompts)
  and its embedding, rebuilt at every call.

Rebuilding them is a visible share of a small model's step and call (docs/benchmarks.md).
`remember_rope` and `remember_relative_bias` keep the last few results (up to 16 MiB each),
keyed by what they are computed from, and hand back the same tensors: the output does not
change by a bit. Only under inference mode, where no autograd graph hangs on a kept tensor.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

KEEP = 4  # results per module: a server alternates between a few sizes
# A bigger result is not kept: T5-XXL's bias for 512 tokens is 64 MiB, in each of UMT5's 24
# layers, and next to those encoders' own work it costs nothing to rebuild.
KEEP_BYTES = 16 << 20


def _nbytes(out: Any) -> int:
    tensors = out if isinstance(out, tuple | list) else (out,)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _remember(compute: Callable, key: Callable[..., Hashable | None]) -> Callable:
    """`compute` with its last KEEP results kept by `key(*args, **kwargs)` (None: compute),
    each result at most KEEP_BYTES."""
    kept: OrderedDict[Hashable, Any] = OrderedDict()

    def remembered(*args, **kwargs):
        k = key(*args, **kwargs) if torch.is_inference_mode_enabled() else None
        if k is None:
            return compute(*args, **kwargs)
        if k in kept:
            kept.move_to_end(k)
            return kept[k]
        out = compute(*args, **kwargs)
        if _nbytes(out) <= KEEP_BYTES:
            kept[k] = out
            if len(kept) > KEEP:
                kept.popitem(last=False)
        return out

    return remembered


def remember_rope(pos_embed: nn.Module) -> None:
    """Flux's `FluxPosEmbed`: the key is the position ids themselves (a few thousand small
    numbers, compared by value; any change of size, layout or offsets is a new key). Ids on an
    accelerator are left alone: reading them back would wait for the device at every step."""

    def key(ids: torch.Tensor):
        if ids.device.type != "cpu" or ids.numel() > 1 << 16:
            return None
        # Bytes through uint8: numpy has no bfloat16 (a bf16 pipeline on a CPU passes bf16 ids).
        return (ids.dtype, tuple(ids.shape),
                ids.contiguous().view(torch.uint8).numpy().tobytes())

    if "forward" not in vars(pos_embed):  # not wrapped yet (a pipeline can be shared)
        pos_embed.forward = _remember(pos_embed.forward, key)


def remember_relative_bias(module: nn.Module) -> int:
    """Every T5 / UMT5 attention of `module` that computes a relative position bias. The key
    holds the lengths, the offset and the bias weights' identity and version, so new weights
    (loaded in place) compute afresh. Returns how many attentions were wrapped."""
    wrapped = 0
    for attn in module.modules():
        table = getattr(attn, "relative_attention_bias", None)
        if (not isinstance(table, nn.Embedding) or "compute_bias" in vars(attn)
                or not callable(getattr(attn, "compute_bias", None))):
            continue  # no bias here, or wrapped already (a pipeline can be shared)

        def key(query_length, key_length, device=None, past_seen_tokens=0, *more,
                _table=table, **unknown):
            if more or unknown:  # a later signature than this was written for: compute it
                return None
            weight = _table.weight
            return (int(query_length), int(key_length), str(device), int(past_seen_tokens),
                    weight.data_ptr(), weight._version, weight.dtype)

        attn.compute_bias = _remember(attn.compute_bias, key)
        wrapped += 1
    return wrapped
