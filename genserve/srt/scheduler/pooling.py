"""The last step of an embedding request: Matryoshka truncation and L2 normalisation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pooled_vector(row: torch.Tensor, dimensions: int | None, normalize: bool) -> list[float]:
    """`row` [hidden] as the request's vector: its first `dimensions` values L2-normalised when
    truncated (a Matryoshka prefix is only meaningful on the unit sphere), else normalised when
    the model ends with a Normalize module."""
    vec = row.float()
    if dimensions is not None:
        vec = F.normalize(vec[:dimensions], dim=-1)
    elif normalize:
        vec = F.normalize(vec, dim=-1)
    return vec.tolist()
