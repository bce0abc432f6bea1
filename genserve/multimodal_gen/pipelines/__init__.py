"""Registry of supported diffusion pipeline families and the model loader.

`load_model(path_or_name, ...)` accepts a name of `named_models` (an embedded builder such as
`tiny-flux`, or a shipped weights folder such as the demo model `shapes-image`), a diffusers
folder (its `model_index.json` names the pipeline class) or a hub id (when allowed). A named
model's family and pipeline class come from its row by dotted path. Runs in the worker process
(imports torch).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from genserve.multimodal_gen.named_models import DIFFUSION_MODELS
from genserve.multimodal_gen.pipelines.base import DiffusionFamily
from genserve.multimodal_gen.pipelines.flux import FluxFamily
from genserve.multimodal_gen.pipelines.flux2 import Flux2Family, Flux2KleinFamily
from genserve.multimodal_gen.pipelines.flux_edit import FluxFillFamily, FluxKontextFamily
from genserve.multimodal_gen.pipelines.helios import HeliosFamily
from genserve.multimodal_gen.pipelines.helios_pyramid import HeliosPyramidFamily
from genserve.multimodal_gen.pipelines.hunyuan_video15 import HunyuanVideo15Family
from genserve.multimodal_gen.pipelines.ltx import LTXFamily
from genserve.multimodal_gen.pipelines.ltx2 import LTX2Family
from genserve.multimodal_gen.pipelines.memory import (
    MemoryOptions,
    place_pipeline,
    quantize_denoiser,
)
from genserve.multimodal_gen.pipelines.qwen_image import QwenImageEditFamily, QwenImageFamily
from genserve.multimodal_gen.pipelines.sd import StableDiffusionFamily
from genserve.multimodal_gen.pipelines.sd3 import SD3Family
from genserve.multimodal_gen.pipelines.sdxl import StableDiffusionXLFamily
from genserve.multimodal_gen.pipelines.wan import WanFamily
from genserve.multimodal_gen.pipelines.wan_i2v import WanImageToVideoFamily
from genserve.multimodal_gen.pipelines.z_image import ZImageFamily
from genserve.named_models import NamedModel, locate, source_path

# The families of diffusers' own pipeline classes. Families of pipeline classes a package
# defines itself (the demo models') come from their named-model rows.
FAMILIES: tuple[type[DiffusionFamily], ...] = (
    FluxFamily, FluxKontextFamily, FluxFillFamily, SD3Family, StableDiffusionFamily,
    StableDiffusionXLFamily, QwenImageFamily, QwenImageEditFamily, WanFamily,
    WanImageToVideoFamily, LTXFamily, HeliosFamily, HeliosPyramidFamily,
    Flux2Family, Flux2KleinFamily, ZImageFamily, HunyuanVideo15Family, LTX2Family,
)


@dataclass(frozen=True)
class LoadOptions:
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    cpu_offload: bool = False  # the same as offload="model" (the older flag)
    memory: MemoryOptions = MemoryOptions()
    # LoRA adapters (name, path) loaded into the model; see pipelines/lora.py.
    loras: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype}")
        if self.cpu_offload and self.memory.offload == "none":
            object.__setattr__(self, "memory", dataclasses.replace(self.memory, offload="model"))


def _row_of_class(class_name: str) -> NamedModel | None:
    """The named-model row whose own pipeline class is `class_name` (diffusers cannot import
    it by name), if any."""
    return next((row for row in DIFFUSION_MODELS.rows
                 if row.pipeline_class_name == class_name), None)


def family_for_class(class_name: str) -> type[DiffusionFamily]:
    for fam in FAMILIES:
        if class_name in fam.pipeline_classes:
            return fam
    row = _row_of_class(class_name)
    if row is not None and row.family:
        return locate(row.family)
    supported = sorted([c for fam in FAMILIES for c in fam.pipeline_classes]
                       + [r.pipeline_class_name for r in DIFFUSION_MODELS.rows if r.pipeline])
    raise ValueError(f"pipeline class {class_name!r} is not supported; supported: {supported}")


def _resolve(options: LoadOptions):
    import torch

    device = options.device
    if device == "auto" or device.startswith("auto:"):
        # "auto:i" is worker i of several (--diffusion-workers): GPU i, else the CPU.
        index = int(device[5:]) if device.startswith("auto:") else 0
        device = (f"cuda:{index % torch.cuda.device_count()}" if torch.cuda.is_available()
                  else "cpu")
    dtype = options.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return torch.device(device), getattr(torch, dtype)


def load_model(path_or_name: str, options: LoadOptions | None = None,
               name: str | None = None) -> DiffusionFamily:
    """Load one model and wrap it in its family."""
    import torch

    options = options or LoadOptions()
    device, dtype = _resolve(options)
    row = DIFFUSION_MODELS.get(path_or_name)
    if row is not None and row.kind == "builder":
        from genserve.multimodal_gen.embedded import build_embedded

        # Weights that will change get their own instance; others share the process's one.
        changes = bool(options.loras) or options.memory != MemoryOptions()
        pipe = build_embedded(path_or_name, shared=not changes)  # built in float32
        if dtype != torch.float32:
            pipe = pipe.to(dtype=dtype)
        return _finish(locate(row.family), name or path_or_name, pipe, "embedded", options,
                       device, row.spec)
    from diffusers import DiffusionPipeline

    if row is not None:  # weights shipped in a package (the trained demo models)
        name = name or path_or_name
        path_or_name = str(source_path(row))
        if not (Path(path_or_name) / "model_index.json").is_file():
            raise ValueError(f"the weights of {name} are missing from {path_or_name}")
    index = Path(path_or_name) / "model_index.json"
    if index.is_file():
        class_name = json.loads(index.read_text())["_class_name"]
    else:
        from genserve import envs

        if not envs.GENSERVE_ALLOW_HUB_DOWNLOAD.get():
            raise ValueError(f"{path_or_name!r} is neither a named model (genserve models) nor "
                             "a diffusers folder with model_index.json (hub downloads are "
                             "disabled)")
        class_name = DiffusionPipeline.load_config(path_or_name)["_class_name"]
    family = locate(row.family) if row is not None and row.family else family_for_class(
        class_name)
    own = row if row is not None and row.pipeline else _row_of_class(class_name)
    pipe_cls = locate(own.pipeline) if own is not None else DiffusionPipeline
    pipe = pipe_cls.from_pretrained(path_or_name, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    model_name = name or (Path(path_or_name).name if index.is_file() else path_or_name)
    overrides = row.spec if row is not None and row.spec else None
    return _finish(family, model_name, pipe, str(path_or_name), options, device, overrides)


def _finish(family: type[DiffusionFamily], name: str, pipe, source: str, options: LoadOptions,
            device, overrides: dict | None = None) -> DiffusionFamily:
    """Quantize, place (or offload) and wrap a loaded pipeline, then load its LoRA adapters."""
    denoiser = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    # A two-expert pipeline (Wan 2.2 A14B) quantizes its low-noise expert alike.
    experts = [m for m in (denoiser, getattr(pipe, "transformer_2", None)) if m is not None]
    if options.memory.quantization != "none":
        if not experts or not all(quantize_denoiser(m, options.memory.quantization)
                                  for m in experts):
            raise ValueError(f"model {name}: {options.memory.quantization} quantization found "
                             "no linear layer to quantize in its denoiser")
    pipe = place_pipeline(pipe, device, options.memory)
    model = family(name, pipe, source, overrides)
    if options.loras:
        from genserve.multimodal_gen.pipelines.lora import load_adapters

        load_adapters(model, options.loras)
    return model
