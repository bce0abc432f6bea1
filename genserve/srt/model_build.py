"""Building a model for the runner: the family's module on the meta device, its storage, its
checkpoint streamed in (quantized layer by layer where asked), and the start-up checks that
decide which kernels and how many tensor-parallel ranks it can run on."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from genserve.srt.distributed import TPGroup
from genserve.srt.layers.parallel import check_tp_experts, check_tp_size
from genserve.srt.layers.quantization import quantize_linear, quantize_model
from genserve.srt.model_config import ModelConfig
from genserve.srt.models.base import CausalLM, Embedding, ModelKernels
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
    model = _empty_storage(model.to(dtype), device)
    model.tie_weights()  # the storage above gives each module its own copy of a shared one
    model.rebuild_buffers(device)  # buffers (the rotary tables) were meta: compute them
    if load_format == "dummy":
        init_dummy_weights(model)
    elif mode != "none" and type(model).load_checkpoint is CausalLM.load_checkpoint:
        if device.type == "cpu" and (tp is None or tp.size == 1) and mode != "fp8":
            # (fp8 leaves the layers it does not keep in float8 as they are: in the model's
            # dtype)
            keep_checkpoint_dtype(model, folder)
        model.load_checkpoint(folder, on_linear_loaded=functools.partial(
            quantize_linear, model, mode=mode), weight_only=mode)
    else:
        model.load_checkpoint(folder)
    quantize_model(model, mode)
    return model.eval()


def _empty_storage(model: nn.Module, device: torch.device) -> nn.Module:
    """`model.to_empty(device=device)` without its `empty_like` of meta tensors: torch runs
    that through its Python meta functions, whose first use in a process imports torch's
    symbolic-shapes module and sympy, a CPU cost every runtime process paid at start-up."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def keep_checkpoint_dtype(model: CausalLM, folder: Path) -> None:
    """Before a quantized load: give the linear weights and the embedding table the
    checkpoint's dtype where it is a narrower float (a bf16 checkpoint served in float32 on a
    CPU). The linear weights are quantized as soon as they are read, so their float32 copy was
    only a loading peak (twice the checkpoint's bytes per layer); the embedding table is kept
    as stored and its lookups are widened to the model's dtype. The values are the same
    either way: a bf16 number is exact in float32."""
    from genserve.srt.model_loader import read_safetensors_header, safetensors_files

    stored: dict[str, set[torch.dtype]] = {}
    for path in safetensors_files(folder):
        for entry in read_safetensors_header(path):
            mapped = model.map_weight_name(entry.name)
            if mapped is not None:
                stored.setdefault(mapped[0], set()).add(entry.dtype)
    modules = dict(model.named_modules())
    tied = {id(p) for n, p in model.named_parameters() if n.endswith("embed_tokens.weight")}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = modules.get(module_name)
        table = isinstance(module, Embedding)
        if leaf != "weight" or not (table or isinstance(module, nn.Linear)):
            continue
        if not table and id(param) in tied:
            continue  # a tied lm_head is the table itself
        dtypes = stored.get(name, set())
        if len(dtypes) != 1:
            continue
        (dtype,) = dtypes
        if dtype not in (torch.bfloat16, torch.float16) or param.dtype != torch.float32:
            continue  # FP8 weights are dequantized through their scales, never kept
        if table:
            module.out_dtype = param.dtype
        param.data = torch.empty(param.shape, dtype=dtype, device=param.device)


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
