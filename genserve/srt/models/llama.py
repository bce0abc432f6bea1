"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k norm)
reading and writing the paged KV pool through the attention backend."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from genserve.srt.forward_batch import ForwardBatch
from genserve.srt.layers.attention.base import AttentionLayerInfo
from genserve.srt.layers.layernorm import RMSNorm
from genserve.srt.layers.rotary_embedding import RotaryEmbedding
from genserve.srt.model_config import ModelConfig


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.info = AttentionLayerInfo(
            layer_id=layer_id,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            scaling=self.head_dim**-0.5,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)  # [tokens, heads, head_dim]
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = fb.attn_backend.forward(q, k, v, self.info, fb)
        return self.o_proj(o.reshape(n, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, rotary)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        fb: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, fb)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, rotary) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Returns float32 logits [batch, vocab] of the last new token of each request."""
        hidden = self.embed_tokens(fb.input_ids)  # [tokens, hidden]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(fb.positions, hidden, residual, fb)
        # Only the rows whose logits are sampled go through the final norm and lm_head.
        hidden = hidden.index_select(0, fb.logits_indices)
        residual = residual.index_select(0, fb.logits_indices)  # type: ignore[union-attr]
        hidden, _ = self.norm(hidden, residual)
        return self.lm_head(hidden).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up projections."""
        params = dict(self.named_parameters())
        fused: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, tensor in weights.items():
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for part, target in (
                ("q_proj", "qkv_proj"),
                ("k_proj", "qkv_proj"),
                ("v_proj", "qkv_proj"),
                ("gate_proj", "gate_up_proj"),
                ("up_proj", "gate_up_proj"),
            ):
                if f".{part}." in name:
                    fused_name = name.replace(f".{part}.", f".{target}.")
                    fused.setdefault(fused_name, {})[part] = tensor
                    break
            else:
                self._copy(params, name, tensor, loaded)
        order = {
            "qkv_proj": ("q_proj", "k_proj", "v_proj"),
            "gate_up_proj": ("gate_proj", "up_proj"),
        }
        for name, parts in fused.items():
            kind = "qkv_proj" if ".qkv_proj." in name else "gate_up_proj"
            missing = [p for p in order[kind] if p not in parts]
            if missing:
                raise ValueError(f"checkpoint is missing {missing} for {name}")
            self._copy(params, name, torch.cat([parts[p] for p in order[kind]], 0), loaded)
        expected = set(params)
        if self.config.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing_params = sorted(expected - loaded)
        if missing_params:
            raise ValueError(f"checkpoint is missing weights: {missing_params[:8]}")

    @staticmethod
    def _copy(params: dict, name: str, tensor: torch.Tensor, loaded: set[str]) -> None:
        if name not in params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(
                f"weight {name}: checkpoint shape {tuple(tensor.shape)} "
                f"!= model {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add(name)


ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
