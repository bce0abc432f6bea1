"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B): Qwen3-VL's vision tower, interleaved
M-RoPE and DeepStack (`qwen3_vl.py`) in front of a decoder whose MLPs are Qwen3-MoE's sparse
experts (`mixtral.py`: `FusedMoE`, torch or Triton kernel). Layers in `mlp_only_layers`, or off
the `decoder_sparse_step` grid, keep a dense MLP. The router always renormalises its top-k
weights (the config has no `norm_topk_prob`).

Each MoE layer's experts are stored as two stacked tensors, `mlp.experts.gate_up_proj` (gate
rows, then up rows) and `mlp.experts.down_proj`, in one of two layouts, told apart by shape as
transformers does:
- the released checkpoints': gate_up_proj [experts, hidden, 2 * inter], down_proj
  [experts, inter, hidden] (the transpose of what the matmul needs);
- transformers 5's `save_pretrained`: gate_up_proj [experts, 2 * inter, hidden], down_proj
  [experts, hidden, inter] (`FusedMoE`'s own `w13` / `w2`).
Where both layouts have the same shape (2 * inter == hidden) the tensor is read in the second,
as transformers reads it. Each expert's gate, up and down matrices are then handed to the
per-expert loader of the MoE families as views (no copy); a checkpoint with per-expert tensors
(`experts.<e>.gate_proj.weight`...) loads as is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from genserve.srt.model_config import ModelConfig
from genserve.srt.models.mixtral import num_experts
from genserve.srt.models.qwen3_moe import Qwen3MoeForCausalLM
from genserve.srt.models.qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLLanguageModel

# A stacked expert tensor: (module prefix, gate_up_proj | down_proj).
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def per_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every stacked expert tensor replaced by per-expert views
    named as Qwen3-MoE names them (`<prefix>.<e>.gate_proj.weight` [inter, hidden], up_proj
    likewise, down_proj [hidden, inter]); the other tensors pass through."""
    hidden = cfg.hidden_size
    inter = cfg.hf.get("moe_intermediate_size") or cfg.intermediate_size
    for name, tensor in weights:
        m = _STACKED.match(name)
        if m is None:
            yield name, tensor
            continue
        prefix, kind = m.groups()
        # The layout the matmul reads, [experts, out, in]; the released one is its transpose.
        rows, cols = (2 * inter, hidden) if kind == "gate_up_proj" else (hidden, inter)
        shape = tuple(tensor.shape)
        if len(shape) == 3 and shape[1:] == (rows, cols):
            stacked = tensor
        elif len(shape) == 3 and shape[1:] == (cols, rows):
            stacked = tensor.transpose(1, 2)
        else:
            raise ValueError(
                f"weight {name!r} has shape {shape}; expected [experts, {cols}, {rows}] or "
                f"[experts, {rows}, {cols}] (hidden_size {hidden}, moe_intermediate_size {inter})"
            )
        if shape[0] != num_experts(cfg):
            raise ValueError(
                f"weight {name!r} stacks {shape[0]} experts; config has {num_experts(cfg)}"
            )
        for e, w in enumerate(stacked.unbind(0)):
            if kind == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", w
            else:
                yield f"{prefix}.{e}.gate_proj.weight", w[:inter]
                yield f"{prefix}.{e}.up_proj.weight", w[inter:]


class Qwen3VLMoeLanguageModel(Qwen3VLLanguageModel, Qwen3MoeForCausalLM):
    """Qwen3-VL's decoder (interleaved M-RoPE, DeepStack, image splicing) with Qwen3-MoE's
    layers: the method resolution order takes `forward` from the first parent and
    `make_layer` / `map_weight_name` (sparse blocks, per-expert names) from the second."""

    renormalize = True


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    hf_config_class = "Qwen3VLMoeConfig"
    language_model_class = Qwen3VLMoeLanguageModel

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:  # type: ignore[override]
        """Qwen3-VL's names, with the stacked experts split per expert first (so that an error
        names the checkpoint's own tensor)."""
        super().load_weights(dict(per_expert_weights(weights.items(), self.config)))
