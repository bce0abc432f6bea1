"""The draft head of `--speculative-algorithm eagle`: EAGLE-1/2's `LlamaForCausalLMEagle`
checkpoint (Li et al., 2024; SGLang's `models/llama_eagle.py` reads the same layout).

The head drafts from the target's features instead of from tokens alone: for the token at
position i + 1 it reads [embed(token_{i+1}), f_i], where f_i is the target's normed last-layer
hidden state at position i (what its lm_head reads), maps the pair through `fc` (2 * hidden ->
hidden) and one or more Llama decoder layers (the first without its input norm), and its
output (hidden + residual, no final norm) is both its prediction of f_{i+1}, fed back for the
next draft token, and, through the target's lm_head, its logits.

On disk: a folder with config.json (`"architectures": ["LlamaForCausalLMEagle"]`, a Llama
config whose `num_hidden_layers` counts the head's layers) and safetensors named without a
`model.` prefix: `fc.weight` (and `fc.bias`), `layers.N.*`; `embed_tokens.weight` and
`lm_head.weight` when the head has its own, else it shares the target's.

An EAGLE-3 head (`LlamaForCausalLMEagle3`) is `eagle3_model.py`'s; this module reads both
kinds of folder and runs either head.

The head's KV lives in a pool of its own with the target pool's size: its entry for position i
sits in the slot the target's KV of position i has, so the target's req_to_token rows, prefix
cache and free list serve the head too (SGLang's layout).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from genserve.srt.device import resolve_device, resolve_dtype
from genserve.srt.forward_batch import ForwardBatch
from genserve.srt.layers.attention.torch_backend import TorchAttnBackend
from genserve.srt.layers.rotary_embedding import RotaryEmbedding
from genserve.srt.mem_cache import create_kv_pool
from genserve.srt.model_config import ModelConfig
from genserve.srt.model_loader import read_safetensors_header, safetensors_files
from genserve.srt.models.base import CausalLM, ModelKernels
from genserve.srt.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from genserve.srt.models.registry import get_model_class
from genserve.srt.server_args import EngineArgs
from genserve.srt.speculative import refuse_vision_target
from genserve.srt.speculative.eagle3_model import ARCHITECTURE as EAGLE3
from genserve.srt.speculative.eagle3_model import Eagle3Head, Eagle3Layout, resolve_eagle3_layout

FLAG = "--speculative-draft-model-path"
ARCHITECTURES = ("LlamaForCausalLMEagle", EAGLE3)


@dataclass(frozen=True)
class EagleCheckpoint:
    path: str
    folder: Path
    config: ModelConfig  # the head's layers, read as a Llama config
    names: frozenset[str]  # the checkpoint's tensor names
    kv_bytes_per_token: int
    eagle3: Eagle3Layout | None = None  # an EAGLE-3 head's layout (None: EAGLE-1/2)


def resolve_eagle_checkpoint(
    args: EngineArgs, target: ModelConfig, pooled: bool
) -> EagleCheckpoint:
    """The EAGLE head folder of `args`, checked against the target: ValueError naming the flag
    when it is missing, of another format, or its hidden size or vocabulary differ."""
    path = str(args.speculative_draft_model_path)
    if pooled:
        raise ValueError("--speculative-algorithm eagle: an embedding model does not decode")
    target_model_cls = get_model_class(target.architecture)
    dtype = resolve_dtype(args.dtype, resolve_device(args.device))
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{FLAG} {path!r}: no EAGLE head there (a folder with config.json "
            "and safetensors is needed)"
        )
    refuse_vision_target(target.multimodal)
    if not issubclass(target_model_cls, LlamaForCausalLM) or (
        target_model_cls.final_hidden is not LlamaForCausalLM.final_hidden
    ):
        raise ValueError(
            f"--speculative-algorithm eagle needs a Llama-family target "
            f"(Llama, Mistral, Qwen2, Qwen3), got {target.architecture}"
        )
    hf = json.loads((folder / "config.json").read_text())
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{FLAG} {path!r} is a {arch} checkpoint; --speculative-algorithm "
            f"eagle reads {', '.join(ARCHITECTURES)}"
        )
    try:
        config = ModelConfig.from_dict(
            {**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
        )
        files = safetensors_files(folder)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{FLAG} {path!r}: {exc}") from exc
    entries = [e for f in files for e in read_safetensors_header(f)]
    names = frozenset(e.name for e in entries)
    elt = torch.tensor([], dtype=dtype).element_size()
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * elt
    if arch == EAGLE3:
        shapes = {e.name.removeprefix("model."): e.shape for e in entries}
        layout = resolve_eagle3_layout(f"{FLAG} {path!r}", hf, config, target, shapes)
        return EagleCheckpoint(path, folder, config, names, kv, layout)
    if config.hidden_size != target.hidden_size:
        raise ValueError(
            f"{FLAG} {path!r} has hidden size {config.hidden_size}, the target "
            f"model {target.hidden_size}; the head must be trained for this target"
        )
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"{FLAG} {path!r} has a vocabulary of {config.vocab_size} tokens, the "
            f"target model {target.vocab_size}; the head must be trained for "
            "this target"
        )
    if "fc.weight" not in names:
        raise ValueError(f"{FLAG} {path!r} has no fc.weight: not an EAGLE head")
    return EagleCheckpoint(path, folder, config, names, kv)


class EagleHead(CausalLM):
    """EAGLE-1/2 draft layers over the target's embedding and lm_head (unless it has its
    own). forward: float32 logits of the `logits_indices` rows; their output features in
    `fb.hidden_out`."""

    supports_quantization = False

    def __init__(
        self,
        cfg: ModelConfig,
        shared: tuple[nn.Module, nn.Module],
        own_embed: bool,
        own_head: bool,
        fc_bias: bool,
        kernels: ModelKernels,
        positions: int | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        rotary = RotaryEmbedding.of_model(cfg, kernels.rotary, table_rows=positions)
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, rotary, kernels=kernels) for i in range(cfg.num_hidden_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE's first layer has none
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embed else None
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False) if own_head else None
        self._shared = shared  # the target's (embed_tokens, lm_head): not this module's

    def map_weight_name(self, hf_name: str) -> tuple[str, Any] | None:
        if hf_name == "layers.0.input_layernorm.weight":
            return None  # the first layer reads fc's output unnormed
        return super().map_weight_name(hf_name)

    def tie_weights(self) -> None:
        """The head never ties: a shared lm_head is the target's."""

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's captured features as the head reads them (as they are)."""
        return hidden

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # the head's vocabulary is the target's

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        embed = self._shared[0] if self.embed_tokens is None else self.embed_tokens
        head = self._shared[1] if self.lm_head is None else self.lm_head
        x = embed(fb.input_ids)
        hidden = self.fc(torch.cat([x, fb.hidden_in.to(x.dtype)], dim=-1))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(fb.positions, hidden, residual, fb)
        out = (hidden + residual).index_select(0, fb.logits_indices)
        fb.hidden_out = out
        return head(out).float()


class EagleRunner:
    """The head, its KV pool (slots shared with the target's pool) and attention backend."""

    def __init__(self, ckpt: EagleCheckpoint, target: Any) -> None:
        from genserve.srt.model_loader import load_checkpoint

        self.target = target
        self.device, self.dtype = target.device, target.dtype
        model = target.model
        cfg = ckpt.config
        shared = (model.embed_tokens, model.lm_head)
        # Heads are often trained with a shorter max_position_embeddings than the target
        # serves (2048): the rotary table covers every position the target's KV can reach.
        positions = max(cfg.max_position_embeddings, target.context_length)
        head: EagleHead | Eagle3Head
        with torch.device("meta"):
            if ckpt.eagle3 is not None:
                head = Eagle3Head(cfg, ckpt.eagle3, shared, target.kernels, positions)
            else:
                head = EagleHead(
                    cfg,
                    shared,
                    "embed_tokens.weight" in ckpt.names,
                    "lm_head.weight" in ckpt.names,
                    "fc.bias" in ckpt.names,
                    target.kernels,
                    positions,
                )
        head = head.to(self.dtype).to_empty(device=self.device)
        head.rebuild_buffers(self.device)
        head._shared = shared  # to_empty left them alone
        load_checkpoint(head, ckpt.folder)
        if isinstance(head, Eagle3Head):
            _check_d2t(head, ckpt.path)
            # The target's forwards leave these layers' outputs in `hidden_out` from now on.
            model.aux_hidden_layers = ckpt.eagle3.aux_layers  # type: ignore[union-attr]
        self.model = head
        self.num_layers = cfg.num_hidden_layers
        self.token_to_kv_pool = create_kv_pool(
            target.max_total_tokens,
            self.dtype,
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            None,
            self.device,
        )
        self.attn_backend = TorchAttnBackend()

    def forward(self, fb: ForwardBatch, hidden_in: torch.Tensor) -> torch.Tensor:
        """Logits of the head over a batch built by the target's runner (its rows and slots),
        its KV in the head's pool; the output features are left in `fb.hidden_out`."""
        fb.token_to_kv_pool, fb.attn_backend = self.token_to_kv_pool, self.attn_backend
        fb.capture_hidden, fb.hidden_in = False, hidden_in
        self.attn_backend.init_forward_metadata(fb)
        return self.model(fb)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head keeps of a target forward's `hidden_out` [tokens, hidden]."""
        return self.model.features(hidden)

    def draft(self, fb: ForwardBatch, hidden_in: torch.Tensor) -> torch.Tensor:
        """The head's greedy token (a target id) for each `logits_indices` row."""
        return self.model.target_ids(self.forward(fb, hidden_in).argmax(dim=-1))


def _check_d2t(head: Eagle3Head, path: str) -> None:
    """ValueError naming the flag when a loaded d2t sends a draft id outside the vocabulary."""
    if head.d2t is None:
        return
    vocab = head.config.vocab_size
    ids = head.target_ids(torch.arange(head.d2t.shape[0], device=head.d2t.device))
    if bool(((ids < 0) | (ids >= vocab)).any()):
        raise ValueError(f"{FLAG} {path!r}: d2t maps draft ids outside the target's {vocab} tokens")
