"""Owns the model weights, the KV memory and the attention backend; runs one forward pass."""

from __future__ import annotations

import logging
from pathlib import Path

import psutil
import torch

from genserve.srt.forward_batch import ForwardBatch, ForwardMode
from genserve.srt.layers.attention.base import AttentionBackend
from genserve.srt.mem_cache import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from genserve.srt.model_config import ModelConfig
from genserve.srt.model_loader import load_state_dict
from genserve.srt.models.llama import ARCHITECTURES
from genserve.srt.server_args import EngineArgs

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Upper bound for automatic pool sizing: plenty for a CPU box, cheap to index.
_MAX_AUTO_TOKENS = 1 << 20


def vlm_architectures() -> dict[str, type[torch.nn.Module]]:
    from genserve.srt.models import llava, qwen2_vl

    return {**qwen2_vl.VLM_ARCHITECTURES, **llava.VLM_ARCHITECTURES}


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def create_attention_backend(name: str, runner: ModelRunner) -> AttentionBackend:
    """Registry of attention backends (torch: CPU default and reference; triton: CUDA default)."""
    if name == "torch":
        from genserve.srt.layers.attention.torch_backend import TorchAttnBackend

        return TorchAttnBackend()
    if name == "triton":
        from genserve.srt.layers.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend(
            runner.num_heads, runner.num_kv_heads, runner.head_dim, runner.device
        )
    raise ValueError(f"unknown attention backend {name!r}")


class ModelRunner:
    def __init__(self, args: EngineArgs, config: ModelConfig, folder: Path, context_length: int):
        self.args = args
        self.config = config
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.context_length = context_length
        torch.manual_seed(args.random_seed)

        model_cls = {**ARCHITECTURES, **vlm_architectures()}[config.architecture]
        with torch.device("meta"):
            model = model_cls(config)
        model = model.to_empty(device=self.device)
        model.tie_weights()  # to_empty gives each module its own copy of a shared parameter
        model.load_weights(load_state_dict(folder))
        # Buffers (the rotary cos/sin table) were created on meta: rebuild them for real.
        if hasattr(model, "rebuild_buffers"):
            model.rebuild_buffers(self.device)
        else:
            self._rebuild_rotary(model)
        self.model = model.to(self.dtype).eval()
        self.model.tie_weights()

        backend = args.attention_backend or ("triton" if self.device.type == "cuda" else "torch")
        self.attention_backend_name = backend
        use_triton = backend == "triton"
        for module in self.model.modules():
            if hasattr(module, "use_triton"):
                module.use_triton = use_triton

        self.max_total_tokens = self._pool_size()
        self.req_to_token_pool = ReqToTokenPool(
            max(2 * args.max_running_requests, 16), context_length + 8, self.device
        )
        self.token_to_kv_pool = MHATokenToKVPool(
            self.max_total_tokens,
            self.dtype,
            config.num_hidden_layers,
            self.num_kv_heads,
            self.head_dim,
            self.device,
        )
        self.allocator = TokenToKVPoolAllocator(self.max_total_tokens, self.device)
        self.attn_backend = create_attention_backend(backend, self)

    def _rebuild_rotary(self, model: torch.nn.Module) -> None:
        from genserve.srt.layers.rotary_embedding import RotaryEmbedding

        cfg = self.config
        rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        ).to(self.device)
        for layer in model.layers:
            layer.self_attn.rotary = rotary

    def kv_bytes_per_token(self) -> int:
        elt = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.config.num_hidden_layers * self.num_kv_heads * self.head_dim * elt

    def _pool_size(self) -> int:
        if self.args.max_total_tokens is not None:
            return self.args.max_total_tokens
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        else:
            free = psutil.virtual_memory().available
        tokens = int(free * self.args.mem_fraction) // self.kv_bytes_per_token()
        return max(256, min(tokens, _MAX_AUTO_TOKENS))

    def build_forward_batch(
        self,
        mode: ForwardMode,
        rows: list[int],
        input_ids: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
        image_embeds: list[tuple[int, torch.Tensor]] | None = None,
        mrope_positions: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """input_ids: the new tokens of every request, concatenated request after request.
        image_embeds / mrope_positions: see `ForwardBatch` (vision-language models only)."""
        dev = self.device
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        starts, acc = [], 0
        positions: list[int] = []
        for p, e in zip(prefix_lens, extend_lens):
            starts.append(acc)
            acc += e
            positions.extend(range(p, p + e))
        ext = torch.tensor(extend_lens, dtype=torch.int64, device=dev)
        start_loc = torch.tensor(starts, dtype=torch.int64, device=dev)
        return ForwardBatch(
            mode=mode,
            batch_size=len(rows),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            out_cache_loc=out_cache_loc,
            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64, device=dev),
            extend_seq_lens=ext,
            extend_start_loc=start_loc,
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=list(extend_lens),
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
            logits_indices=start_loc + ext - 1,
            image_embeds=image_embeds,
            mrope_positions=mrope_positions,
        )

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Float32 logits [batch, vocab] of each request's last new token."""
        self.attn_backend.init_forward_metadata(fb)
        return self.model(fb)
