"""Registry of supported diffusion pipeline families and the model loader.

`load_model(path_or_name, ...)` accepts an embedded name (`tiny-flux`, `tiny-wan`), a demo model
name (`shapes-image`, `shapes-video`: trained weights shipped in the package), a diffusers
folder (its `model_index.json` names the pipeline class) or a hub id (when allowed). Runs in the
worker process (imports torch).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from genserve.multimodal_gen.pipelines.base import DiffusionFamily
from genserve.multimodal_gen.pipelines.flux import FluxFamily
from genserve.multimodal_gen.pipelines.flux_edit import FluxFillFamily, FluxKontextFamily
from genserve.multimodal_gen.pipelines.helios import HeliosFamily
from genserve.multimodal_gen.pipelines.helios_pyramid import HeliosPyramidFamily
from genserve.multimodal_gen.pipelines.ltx import LTXFamily
from genserve.multimodal_gen.pipelines.memory import (
    MemoryOptions,
    place_pipeline,
    quantize_denoiser,
)
from genserve.multimodal_gen.pipelines.qwen_image import QwenImageEditFamily, QwenImageFamily
from genserve.multimodal_gen.pipelines.sd import StableDiffusionFamily
from genserve.multimodal_gen.pipelines.sd3 import SD3Family
from genserve.multimodal_gen.pipelines.sdxl import StableDiffusionXLFamily
from genserve.multimodal_gen.pipelines.shapes import ShapesImageFamily, ShapesVideoFamily
from genserve.multimodal_gen.pipelines.wan import WanFamily
from genserve.multimodal_gen.pipelines.wan_i2v import WanImageToVideoFamily

FAMILIES: tuple[type[DiffusionFamily], ...] = (
    FluxFamily, FluxKontextFamily, FluxFillFamily, SD3Family, StableDiffusionFamily,
    StableDiffusionXLFamily, QwenImageFamily, QwenImageEditFamily, WanFamily,
    WanImageToVideoFamily, LTXFamily, HeliosFamily, HeliosPyramidFamily, ShapesImageFamily,
    ShapesVideoFamily,
)
# Pipeline classes genserve defines itself (diffusers cannot look them up by name).
OWN_PIPELINES = {
    "ShapesImagePipeline": "genserve.demo_models.pipeline",
    "ShapesVideoPipeline": "genserve.demo_models.pipeline",
}

# Embedded models: a family, the builder name and spec defaults sized for a CPU.
EMBEDDED_SPECS: dict[str, tuple[type[DiffusionFamily], dict]] = {
    "tiny-flux": (FluxFamily, dict(default_width=64, default_height=64, default_steps=4,
                                   max_pixels=512 * 512, default_guidance=3.5)),
    "tiny-wan": (WanFamily, dict(default_width=64, default_height=64, default_steps=4,
                                 default_num_frames=9, max_num_frames=33, max_pixels=256 * 256,
                                 default_guidance=1.0, default_fps=8)),
    # Not served by default: they exercise the other families in tests.
    "tiny-sd3": (SD3Family, dict(default_width=64, default_height=64, default_steps=4,
                                 max_pixels=512 * 512, default_guidance=5.0)),
    "tiny-sd": (StableDiffusionFamily, dict(default_width=64, default_height=64,
                                            default_steps=4, max_pixels=512 * 512,
                                            default_guidance=5.0)),
    "tiny-ltx": (LTXFamily, dict(default_width=64, default_height=64, default_steps=4,
                                 default_num_frames=9, max_num_frames=33, max_pixels=256 * 256,
                                 default_guidance=3.0, default_fps=8)),
    "tiny-sdxl": (StableDiffusionXLFamily, dict(default_width=64, default_height=64,
                                                default_steps=4, max_pixels=512 * 512,
                                                default_guidance=5.0)),
    "tiny-flux-kontext": (FluxKontextFamily, dict(default_width=64, default_height=64,
                                                  default_steps=4, max_pixels=512 * 512)),
    "tiny-flux-fill": (FluxFillFamily, dict(default_width=64, default_height=64,
                                            default_steps=4, max_pixels=512 * 512)),
    "tiny-wan-i2v": (WanImageToVideoFamily, dict(default_width=64, default_height=64,
                                                 default_steps=4, default_num_frames=9,
                                                 max_num_frames=33, max_pixels=256 * 256,
                                                 default_guidance=1.0, default_fps=8)),
    "tiny-qwen-image": (QwenImageFamily, dict(default_width=64, default_height=64,
                                              default_steps=4, max_pixels=512 * 512)),
    "tiny-qwen-image-edit": (QwenImageEditFamily, dict(default_width=64, default_height=64,
                                                       default_steps=4, max_pixels=512 * 512)),
    "tiny-helios": (HeliosFamily, dict(default_width=64, default_height=64, default_steps=2,
                                       max_pixels=256 * 256, default_guidance=1.0,
                                       default_fps=8)),
    "tiny-helios-pyramid": (HeliosPyramidFamily, dict(default_width=64, default_height=64, default_steps=2, max_pixels=256 * 256, default_guidance=1.0, default_fps=8)),  # noqa: E501
    "tiny-helios-distilled": (HeliosPyramidFamily, dict(default_width=64, default_height=64, default_steps=1, max_pixels=256 * 256, default_guidance=1.0, default_fps=8)),  # noqa: E501
}


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


def family_for_class(class_name: str) -> type[DiffusionFamily]:
    for fam in FAMILIES:
        if class_name in fam.pipeline_classes:
            return fam
    supported = sorted(c for fam in FAMILIES for c in fam.pipeline_classes)
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
    if path_or_name in EMBEDDED_SPECS:
        from genserve.multimodal_gen.embedded import build_embedded

        family, overrides = EMBEDDED_SPECS[path_or_name]
        # Weights that will change get their own instance; others share the process's one.
        changes = bool(options.loras) or options.memory != MemoryOptions()
        pipe = build_embedded(path_or_name, shared=not changes)  # built in float32
        if dtype != torch.float32:
            pipe = pipe.to(dtype=dtype)
        return _finish(family, name or path_or_name, pipe, "embedded", options, device,
                       overrides)
    from diffusers import DiffusionPipeline

    from genserve.demo_models.models import MODEL_NAMES

    if path_or_name in MODEL_NAMES.values():  # a trained demo model shipped in the package
        from genserve.demo_models.models import weights_path

        kind = next(k for k, v in MODEL_NAMES.items() if v == path_or_name)
        name = name or path_or_name
        path_or_name = str(weights_path(kind))
        if not (Path(path_or_name) / "model_index.json").is_file():
            raise ValueError(f"the demo model's weights are missing from {path_or_name}")
    index = Path(path_or_name) / "model_index.json"
    if index.is_file():
        class_name = json.loads(index.read_text())["_class_name"]
    else:
        from genserve import envs

        if not envs.GENSERVE_ALLOW_HUB_DOWNLOAD.get():
            raise ValueError(f"{path_or_name!r} is neither an embedded model nor a diffusers "
                             "folder with model_index.json (hub downloads are disabled)")
        class_name = DiffusionPipeline.load_config(path_or_name)["_class_name"]
    family = family_for_class(class_name)
    pipe_cls = DiffusionPipeline
    if class_name in OWN_PIPELINES:
        import importlib

        pipe_cls = getattr(importlib.import_module(OWN_PIPELINES[class_name]), class_name)
    pipe = pipe_cls.from_pretrained(path_or_name, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    model_name = name or (Path(path_or_name).name if index.is_file() else path_or_name)
    return _finish(family, model_name, pipe, str(path_or_name), options, device)


def _finish(family: type[DiffusionFamily], name: str, pipe, source: str, options: LoadOptions,
            device, overrides: dict | None = None) -> DiffusionFamily:
    """Quantize, place (or offload) and wrap a loaded pipeline, then load its LoRA adapters."""
    denoiser = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    if options.memory.quantization != "none":
        if denoiser is None or not quantize_denoiser(denoiser, options.memory.quantization):
            raise ValueError(f"model {name}: {options.memory.quantization} quantization found "
                             "no linear layer to quantize in its denoiser")
    pipe = place_pipeline(pipe, device, options.memory)
    model = family(name, pipe, source, overrides)
    if options.loras:
        from genserve.multimodal_gen.pipelines.lora import load_adapters

        load_adapters(model, options.loras)
    return model
