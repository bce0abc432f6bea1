"""GPT-OSS: the Llama decoder with OpenAI's choices.

- attention: q/k/v and output projections biased (`attention_bias`); one learned sink logit
  per query head joins every softmax (it takes probability mass and contributes no value);
  layers alternate between a `sliding_window` band and full attention as `layer_types` says;
  YaRN rotary (read from `rope_parameters` like any family's);
- MLP: a mixture of experts. The router (biased) takes the top-k logits and softmaxes over
  those k only; each expert is a clamped SwiGLU, `(clamp(up, -l, l) + 1) * g * sigmoid(alpha *
  g)` with `g = min(gate, l)`, whose gate and up columns are interleaved in one `gate_up_proj`
  [experts, hidden, 2 * inter] (the checkpoint's own layout, kept as stored), with biases on
  both projections.

The experts run the torch grouped path on every device: the Triton fused-MoE kernel has no
biases or clamped SwiGLU. The checkpoint's MXFP4 experts (`*_blocks` / `*_scales`) are
dequantized once at load time by `layers/prequantized/mxfp4.py`. Attention needs the torch
backend (the Triton kernels have no sinks; the runner refuses that pairing at start-up).

Tensor parallel as the Mixtral family: heads (and their sinks) split across ranks with the
Llama attention split, each rank holds a contiguous slice of the experts (and loads only those
rows of the stacked expert tensors), the router is replicated, and the block's partial sums are
all-reduced once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from genserve.srt.distributed import TPGroup
from genserve.srt.forward_batch import ForwardBatch
from genserve.srt.layers.attention.base import AttentionLayerInfo
from genserve.srt.layers.parallel import RowParallelLinear, Slice, column_split, split_heads
from genserve.srt.layers.rotary_embedding import RotaryEmbedding
from genserve.srt.model_config import ModelConfig
from genserve.srt.models.base import ModelKernels
from genserve.srt.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

_SINGLE = TPGroup.single()


class GptOssAttention(LlamaAttention):
    """Llama's attention with a biased output projection and per-head sink logits."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 kernels: ModelKernels, tp: TPGroup) -> None:
        bias = bool(cfg.hf.get("attention_bias", True))
        super().__init__(cfg, layer_id, rotary, kernels=kernels, qkv_bias=bias, qk_norm=False,
                         tp=tp)
        heads = split_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        self.q_start, self.tp_size = heads.q_start, tp.size
        d = self.head_dim
        self.o_proj = RowParallelLinear((heads.q_start * d, self.q_size), cfg.hidden_size, tp,
                                        bias=bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))
        self.info = AttentionLayerInfo(
            layer_id=layer_id,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=d,
            scaling=d**-0.5,
            sliding_window=cfg.layer_window(layer_id),
            sinks=True,
        )

    def checkpoint_slice(self, leaf: str, shard: object) -> Slice | None:
        """A rank loads the sinks of its own query heads."""
        if leaf != "sinks" or self.tp_size == 1:
            return None
        return 0, self.q_start, self.num_heads

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        o = fb.attn_backend.forward(q, k, v, self.info, fb, sinks=self.sinks)
        return self.o_proj(o.reshape(n, self.q_size))


class GptOssExperts(nn.Module):
    """This rank's experts, stacked as the checkpoint stores them: `gate_up_proj`
    [experts, hidden, 2 * inter] (gate and up columns interleaved), `down_proj`
    [experts, inter, hidden], and their biases."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        hf = cfg.hf
        total = hf["num_local_experts"]
        self.start, self.count = column_split(total, tp)
        self.total = total
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.count, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(self.count, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(self.count, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(self.count, hidden))
        self.alpha = float(hf.get("swiglu_alpha", 1.702))
        self.limit = float(hf.get("swiglu_limit", 7.0))

    def checkpoint_slice(self, leaf: str, shard: object) -> Slice | None:
        """The rows of this rank's experts in every stacked expert tensor."""
        if self.count == self.total:
            return None
        return 0, self.start, self.count

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [tokens, hidden]; weights / ids: [tokens, k] over all experts. The sum over this
        rank's experts only."""
        out = torch.zeros_like(x)
        local = ids - self.start
        local = local.masked_fill((local < 0) | (local >= self.count), self.count)
        # [experts, k, tokens]: which (token, slot) pairs each local expert serves.
        hits = F.one_hot(local, self.count + 1)[..., : self.count].permute(2, 1, 0)
        for e in torch.nonzero(hits.sum(dim=(1, 2))).flatten().tolist():
            slot, token = torch.where(hits[e])
            gate_up = x[token] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            gate = gate_up[..., ::2].clamp(max=self.limit)
            up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
            h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
            h = h @ self.down_proj[e] + self.down_proj_bias[e]
            out.index_add_(0, token, h * weights[token, slot, None])
        return out


class GptOssMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        experts = cfg.hf["num_local_experts"]
        self.top_k = int(cfg.hf["num_experts_per_tok"])
        if not 0 < self.top_k <= experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, {experts}]")
        self.router = nn.Linear(cfg.hidden_size, experts, bias=True)  # replicated
        self.experts = GptOssExperts(cfg, tp)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)  # over the k chosen logits only
        return self.tp.all_reduce(self.experts(x, weights, ids))


class GptOssForCausalLM(LlamaForCausalLM):
    supports_tp = True

    def __init__(self, cfg: ModelConfig, kernels: ModelKernels = ModelKernels(),
                 tp: TPGroup = _SINGLE) -> None:
        if "num_local_experts" not in cfg.hf or "num_experts_per_tok" not in cfg.hf:
            raise ValueError("config.json of a GPT-OSS model needs num_local_experts and "
                             "num_experts_per_tok")
        super().__init__(cfg, kernels, tp)

    def make_layer(self, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        layer = LlamaDecoderLayer(self.config, layer_id, rotary, kernels=self.kernels,
                                  qk_norm=False, tp=self.tp)
        layer.self_attn = GptOssAttention(  # type: ignore[assignment]
            self.config, layer_id, rotary, self.kernels, self.tp)
        layer.mlp = GptOssMoE(self.config, self.tp)  # type: ignore[assignment]
        return layer
