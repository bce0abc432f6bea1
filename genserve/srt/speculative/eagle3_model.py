"""The EAGLE-3 draft head (`LlamaForCausalLMEagle3`, Li et al., 2025): the layout SpecForge
writes and SGLang's `models/llama_eagle3.py` reads.

Where EAGLE-1 reads the target's last normed hidden state, EAGLE-3 reads the outputs (before
any norm: hidden + residual) of a few of the target's layers, concatenated ([tokens,
k * target_hidden]); `fc` maps them to the head's width. Which layers: the head's config
`eagle_config.eagle_aux_hidden_state_layer_ids` (each id names the layer whose output is taken,
counting from 0), else SpecForge's default (1, n/2 - 1, n - 4) for an n-layer target.

The head is one decoder layer whose attention reads [input_layernorm(embed(token)),
hidden_norm(feature)] (q/k/v projections 2 * hidden wide) and whose residual stream starts
at the feature; its own final norm and lm_head give logits over a draft vocabulary of
`draft_vocab_size` tokens, and the `d2t` tensor maps a draft id to the target's
(target = draft + d2t[draft]). The stream before the final norm is the head's prediction of
the next feature: a further draft step reads it in place of the projected target features.

On disk (names with or without a `model.` prefix): `fc.weight`, `midlayer.*` (Llama layer
names plus `hidden_norm`), `norm.weight`, `lm_head.weight` and `d2t` (`t2d` is not needed).
The token embedding is the target's unless the head's width differs from the target's (then
the folder's `embed_tokens.weight`). Without `draft_vocab_size` the lm_head is the target's;
with `tie_word_embeddings` it is the embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from genserve.srt.forward_batch import ForwardBatch
from genserve.srt.layers.layernorm import RMSNorm
from genserve.srt.layers.rotary_embedding import RotaryEmbedding
from genserve.srt.model_config import ModelConfig
from genserve.srt.models.base import CausalLM, MergedLinear, ModelKernels
from genserve.srt.models.llama import LlamaAttention, LlamaMLP

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class Eagle3Layout:
    """What an EAGLE-3 checkpoint holds beyond its Llama config."""

    aux_layers: tuple[int, ...]  # the target layers whose outputs it reads, ascending
    target_hidden: int
    draft_vocab: int  # rows of its logits
    own_embed: bool  # its embed_tokens (else the target's)
    own_head: bool  # its lm_head over the draft vocabulary (else the target's or tied)
    has_d2t: bool
    fc_bias: bool


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """SpecForge's default: the outputs of layers 1, n/2 - 1 and n - 4."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def resolve_eagle3_layout(
    where: str,
    hf: dict[str, Any],
    cfg: ModelConfig,
    target: ModelConfig,
    shapes: dict[str, tuple[int, ...]],
) -> Eagle3Layout:
    """Check an EAGLE-3 head (its config and tensor shapes, names without `model.`) against
    the target; ValueError starting with `where` when they do not fit."""
    n = target.num_hidden_layers
    h = cfg.hidden_size
    if cfg.num_hidden_layers != 1:
        raise ValueError(
            f"{where} has {cfg.num_hidden_layers} decoder layers; EAGLE-3 heads "
            "with one (SpecForge's `midlayer`) are read"
        )
    target_hidden = int(hf.get("target_hidden_size") or h)
    if target_hidden != target.hidden_size:
        raise ValueError(
            f"{where} reads features of hidden size {target_hidden}, the target "
            f"model has {target.hidden_size}; the head must be trained for this "
            "target"
        )
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"{where} has a vocabulary of {cfg.vocab_size} tokens, the target "
            f"model {target.vocab_size}; the head must be trained for this target"
        )
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(int(i) for i in ids) if ids else default_aux_layers(n)
    if len(set(layers)) != len(layers) or not all(0 <= i < n for i in layers):
        how = "eagle_config.eagle_aux_hidden_state_layer_ids" if ids else "the default"
        raise ValueError(
            f"{where}: {how} names target layers {list(layers)}; a {n}-layer "
            f"target needs distinct ids in [0, {n})"
        )
    want = (h, len(layers) * target_hidden)
    fc = shapes.get("fc.weight")
    if fc is None:
        raise ValueError(f"{where} has no fc.weight: not an EAGLE-3 head")
    if tuple(fc) != want:
        raise ValueError(
            f"{where}: fc.weight is {list(fc)}; reading {len(layers)} target "
            f"layers of width {target_hidden} into width {h} needs {list(want)}"
        )
    q = shapes.get("midlayer.self_attn.q_proj.weight")
    if q is None or q[-1] != 2 * h:
        raise ValueError(
            f"{where}: midlayer.self_attn.q_proj.weight is "
            f"{None if q is None else list(q)}; an EAGLE-3 layer reads "
            f"[embedding, feature] ({2 * h} wide)"
        )
    own_embed = h != target.hidden_size
    if own_embed and shapes.get("embed_tokens.weight") != (cfg.vocab_size, h):
        raise ValueError(
            f"{where} is {h} wide, the target {target.hidden_size}: it needs its "
            f"own embed_tokens.weight [{cfg.vocab_size}, {h}]"
        )
    draft_vocab = hf.get("draft_vocab_size")
    tied = cfg.tie_word_embeddings
    own_head = not tied and draft_vocab is not None
    draft_vocab = int(draft_vocab) if own_head else cfg.vocab_size
    if tied and hf.get("draft_vocab_size") not in (None, cfg.vocab_size):
        raise ValueError(
            f"{where} ties lm_head to the embedding yet has draft_vocab_size "
            f"{hf['draft_vocab_size']} (not {cfg.vocab_size})"
        )
    if own_head:
        if not 0 < draft_vocab <= cfg.vocab_size:
            raise ValueError(
                f"{where}: draft_vocab_size {draft_vocab} is not in [1, {cfg.vocab_size}]"
            )
        if shapes.get("lm_head.weight") != (draft_vocab, h):
            raise ValueError(
                f"{where}: lm_head.weight is {shapes.get('lm_head.weight')}, "
                f"draft_vocab_size {draft_vocab} needs [{draft_vocab}, {h}]"
            )
    has_d2t = own_head and "d2t" in shapes
    if own_head and draft_vocab < cfg.vocab_size and not has_d2t:
        raise ValueError(
            f"{where} drafts over {draft_vocab} of the {cfg.vocab_size} tokens "
            "but has no d2t tensor mapping its ids to the target's"
        )
    if has_d2t and tuple(shapes["d2t"]) != (draft_vocab,):
        raise ValueError(
            f"{where}: d2t is {list(shapes['d2t'])}, draft_vocab_size "
            f"{draft_vocab} needs [{draft_vocab}]"
        )
    return Eagle3Layout(
        tuple(sorted(layers)),
        target_hidden,
        draft_vocab,
        own_embed,
        own_head,
        has_d2t,
        "fc.bias" in shapes,
    )


class Eagle3DecoderLayer(nn.Module):
    """A Llama layer whose attention reads [input_layernorm(embeds), hidden_norm(hidden)]."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, kernels: ModelKernels) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = LlamaAttention(cfg, 0, rotary, kernels=kernels, qkv_bias=False)
        attn = self.self_attn
        attn.qkv_proj = MergedLinear(
            2 * h, {"q": attn.q_size, "k": attn.kv_size, "v": attn.kv_size}
        )
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(h, eps, kernels.norm)
        self.hidden_norm = RMSNorm(h, eps, kernels.norm)
        self.post_attention_layernorm = RMSNorm(h, eps, kernels.norm)

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """The stream after the layer (hidden + residual) [tokens, hidden]."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(positions, x, fb)
        x, residual = self.post_attention_layernorm(x, hidden)
        return self.mlp(x) + residual


class Eagle3Head(CausalLM):
    """forward: float32 logits over the draft vocabulary of the `logits_indices` rows, from
    `fb.hidden_in` (features already through `fc`, or the head's own earlier output); their
    pre-norm outputs in `fb.hidden_out`."""

    supports_quantization = False

    def __init__(
        self,
        cfg: ModelConfig,
        layout: Eagle3Layout,
        shared: tuple[nn.Module, nn.Module],
        kernels: ModelKernels,
        positions: int | None = None,
    ) -> None:
        """positions: rows of the rotary table (default: the config's
        max_position_embeddings)."""
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        rotary = RotaryEmbedding.of_model(cfg, kernels.rotary, table_rows=positions)
        self.fc = nn.Linear(len(layout.aux_layers) * layout.target_hidden, h, bias=layout.fc_bias)
        self.midlayer = Eagle3DecoderLayer(cfg, rotary, kernels)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, kernels.norm)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if layout.own_embed else None
        self.lm_head = nn.Linear(h, layout.draft_vocab, bias=False) if layout.own_head else None
        # target id = draft id + d2t[draft id]
        self.d2t = (
            nn.Parameter(torch.zeros(layout.draft_vocab, dtype=torch.int64), requires_grad=False)
            if layout.has_d2t
            else None
        )
        self._shared = shared  # the target's (embed_tokens, lm_head): not this module's

    def map_weight_name(self, hf_name: str) -> tuple[str, Any] | None:
        name = hf_name.removeprefix("model.")
        unused = (
            name == "t2d"
            or (name == "d2t" and self.d2t is None)
            or (name == "embed_tokens.weight" and self.embed_tokens is None)
            or (name == "lm_head.weight" and self.lm_head is None)
        )
        return None if unused else super().map_weight_name(name)

    def tie_weights(self) -> None:
        """A tied lm_head is whichever embedding the head uses (see `forward`)."""

    def _embed(self) -> nn.Module:
        return self._shared[0] if self.embed_tokens is None else self.embed_tokens

    def features(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated layer outputs [tokens, k * target_hidden] through fc."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        embeds = self._embed()(fb.input_ids)
        assert fb.hidden_in is not None
        out = self.midlayer(fb.positions, embeds, fb.hidden_in.to(embeds.dtype), fb)
        out = out.index_select(0, fb.logits_indices)
        fb.hidden_out = out
        normed = self.norm(out)
        if self.lm_head is not None:
            logits = self.lm_head(normed)
        elif self.config.tie_word_embeddings:
            logits = F.linear(normed, self._embed().weight[: self.config.vocab_size])
        else:
            logits = self._shared[1](normed)
        return logits.float()
