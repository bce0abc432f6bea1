"""Building a model for the runner: the family's module on the meta device, its storage, its
checkpoint streamed in (quantized layer by layer where asked), and the start-up checks that
decide which kernels and how many tensor-parallel ranks it can run on."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from genserve.srt.distributed import TPGroup
from genserve.srt.layers.parallel import check_tp_experts, check_tp_size
from genserve.srt.layers.quantization import quantize_linear, quantize_model
from genserve.srt.model_config import ModelConfig
from genserve.srt.models.base import CausalLM, ModelKernels
from genserve.srt.models.registry import get_model_class
from genserve.srt.server_args import EngineArgs


def load_model(
    config: ModelConfig,
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
    kernels: ModelKernels,
    tp: TPGroup | None = None,
    pooled: bool = False,
    load_format: str = "auto",
    quantization: Callable[[CausalLM], str] | None = None,
) -> CausalLM:
    """Build the family's model on the meta device, give it empty storage in `dtype` on
    `device`, and stream the checkpoint into it: no weight ever exists in another dtype.
    With a tensor-parallel group of size > 1 the model holds this rank's share.
    Text and vision-language models load the same way; `pooled` loads the family's embedder
    (`models/embedding.py`). load_format "dummy" fills the weights with random values instead
    of reading a checkpoint.
    quantization: given the (meta) model, its weight-only mode. Where the family streams its
    checkpoint, each linear layer is quantized as soon as its weight is whole: the storage of
    the full-precision model is allocated but its pages are touched, then freed, one layer at
    a time. The rest (a tied lm_head, state-dict families) is quantized after loading."""
    model_cls = get_model_class(config.architecture, pooled=pooled)
    with torch.device("meta"):
        model = model_cls(config, kernels, tp) if tp is not None and tp.size > 1 else (
            model_cls(config, kernels))
    mode = quantization(model) if quantization is not None else "none"
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()  # to_empty gives each module its own copy of a shared parameter
    model.rebuild_buffers(device)  # buffers (the rotary tables) were meta: compute them
    if load_format == "dummy":
        init_dummy_weights(model)
    elif mode != "none" and type(model).load_checkpoint is CausalLM.load_checkpoint:
        model.load_checkpoint(folder, on_linear_loaded=functools.partial(
            quantize_linear, model, mode=mode))
    else:
        model.load_checkpoint(folder)
    quantize_model(model, mode)
    return model.eval()


def init_dummy_weights(model: torch.nn.Module, bound: float = 1e-3) -> None:
    """Every floating-point parameter uniform in [-bound, bound] (vLLM's and SGLang's dummy
    weights: small enough that activations stay finite through every layer), from torch's
    current seed (the runner seeds it with `random_seed`)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.uniform_(-bound, bound)


def choose_kernels(
    args: EngineArgs, device: torch.device, model_cls: type[CausalLM]
) -> ModelKernels:
    """The norm, rotary and MoE kernels: as asked, else the device's (triton on CUDA); a
    rotary kernel the family does not implement is refused, never silently swapped."""
    kernel = "triton" if device.type == "cuda" else "torch"
    supported = model_cls.rotary_kernels
    rotary = args.rotary_kernel or (kernel if kernel in supported else supported[0])
    if rotary not in supported:
        raise ValueError(
            f"--rotary-kernel {rotary} is not supported for {model_cls.__name__}; "
            f"use one of {', '.join(supported)}"
        )
    return ModelKernels(
        norm=args.norm_kernel or kernel, rotary=rotary, moe=args.moe_kernel or kernel
    )


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """ValueError when this model cannot run on `tp_size` tensor-parallel ranks."""
    if tp_size == 1:
        return
    if not get_model_class(config.architecture).supports_tp:
        raise ValueError(f"--tp is not supported for {config.architecture} yet")
    check_tp_size(config.num_attention_heads, config.num_key_value_heads, tp_size)
    experts = config.hf.get("num_local_experts") or config.hf.get("num_experts")
    if experts:
        check_tp_experts(experts, tp_size)
